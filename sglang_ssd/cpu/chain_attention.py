"""Chain-verify attention at linear cost (pure torch; the CPU TARGET_VERIFY path).

A chain verify scores n = K+1 tokens per request that sit at positions P..P+n-1 after the
request's committed prefix of P tokens; their KV is already written to the slots the scheduler
registered in ``req_to_token[r, P:P+n]``.  Query i may attend keys 0..P+i: the prefix plus the
causal part of the chain.

SGLang's torch_native extend path would compute this by building a query buffer as long as the
whole request (P + n rows, only the last n of them real) and running causal SDPA over all of it:
O((P+n)^2) per request and layer, so a verify round grows quadratically with context while an
AR decode step grows linearly.  Here attention is computed for exactly the n chain queries of
each request against its P + n keys: O(n (P+n)), the cost shape of n decode steps' attention.

Requests are batched into one SDPA call per group of similar lengths (keys padded to the group's
longest request and masked), so a batch of b requests costs a few calls per layer rather than b;
a group is closed when padding would exceed ``PAD_SLACK`` of its real key count.
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

PAD_SLACK = 1.25  # a group's padded key rows may be at most this multiple of its real rows


def length_groups(lens: list[int], slack: float = PAD_SLACK) -> list[list[int]]:
    """Partition request indices into groups whose padded size (count x longest) stays within
    ``slack`` x their summed length.  Longest first, so each group's max is its first member."""
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    groups: list[list[int]] = []
    total = 0
    for i in order:
        if groups and (len(groups[-1]) + 1) * lens[groups[-1][0]] <= slack * (total + lens[i]):
            groups[-1].append(i)
            total += lens[i]
        else:
            groups.append([i])
            total = lens[i]
    return groups


def chain_verify_attention(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                           prefix_lens: list[int], n: int, scaling: float | None = None,
                           enable_gqa: bool = False) -> torch.Tensor:
    """Attention of each request's n chain queries over its prefix + causal chain.

    q: [b*n, H, D] (request-major, n rows each); out: [b*n, H, Dv], written in place and returned;
    k_cache / v_cache: [slots, Hkv, D / Dv]; req_to_token: [reqs, max_context]; req_pool_indices: [b];
    prefix_lens: committed lengths P_r (host ints).  The chain's KV must already be in the cache.
    """
    b = len(prefix_lens)
    if b == 0:
        return out
    lens = [p + n for p in prefix_lens]
    hq, d = q.shape[1], q.shape[2]
    q4 = q.view(b, n, hq, d)
    o4 = out.view(b, n, hq, out.shape[-1])
    ar_n = torch.arange(n, device=q.device)
    for group in length_groups(lens):
        g = len(group)
        lmax = lens[group[0]]
        idx = torch.as_tensor(group, device=q.device)
        glens = torch.as_tensor([lens[i] for i in group], device=q.device)
        cols = torch.arange(lmax, device=q.device)
        slots = req_to_token[req_pool_indices[idx].long(), :lmax]          # [g, lmax]
        if g > 1:  # padded key rows read the request's first slot (finite values), then are masked
            slots = torch.where(cols[None, :] < glens[:, None], slots, slots[:, :1])
        keys = k_cache[slots.long()]                                       # [g, lmax, Hkv, D]
        vals = v_cache[slots.long()]
        if keys.dtype != q.dtype:  # SDPA wants one dtype (e.g. an fp8 KV cache)
            keys, vals = keys.to(q.dtype), vals.to(q.dtype)
        pos = (glens - n)[:, None] + ar_n[None, :]                         # [g, n] query positions
        mask = cols[None, None, :] <= pos[:, :, None]                      # [g, n, lmax]: key <= query
        hkv = keys.shape[2]
        rep = hq // hkv if enable_gqa else 1
        # GQA without expanding K/V: the `rep` query heads that share a KV head are stacked along
        # the query axis, so each KV head is read once by one [rep*n, lmax] attention
        qg = q4[idx].view(g, n, hkv, rep, d).permute(0, 2, 3, 1, 4).reshape(g, hkv, rep * n, d)
        res = scaled_dot_product_attention(
            qg, keys.transpose(1, 2), vals.transpose(1, 2),
            attn_mask=mask.repeat(1, rep, 1)[:, None], scale=scaling)    # [g, Hkv, rep*n, Dv]
        dv = res.shape[-1]
        o4[idx] = res.view(g, hkv, rep, n, dv).permute(0, 3, 1, 2, 4).reshape(g, n, hq, dv).to(out.dtype)
    return out
