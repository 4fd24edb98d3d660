"""The linear-cost chain verify attention (sglang_ssd/cpu/chain_attention.py) against SGLang's own
torch_native extend path (the quadratic route the hook used before), on random paged KV caches."""

import pytest
import torch

from sglang_ssd.cpu.chain_attention import chain_verify_attention, length_groups


def _sglang_extend(q, k_cache, v_cache, req_to_token, pool_idx, prefix, n, scale, gqa):
    """What torch_native's TARGET_VERIFY-as-extend computed: causal extend of n over the prefix."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    out = torch.empty(q.shape[0], q.shape[1], v_cache.shape[-1], dtype=q.dtype)
    p = torch.as_tensor(prefix)
    return TorchNativeAttnBackend._run_sdpa_forward_extend(
        None, q, out, k_cache, v_cache, req_to_token, pool_idx, p + n, p, torch.full_like(p, n),
        scaling=scale, enable_gqa=gqa, causal=True)


def _case(seed, b, n, hq, hkv, d, max_prefix, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(1, max_prefix, (b,), generator=g).tolist()
    if b > 3:  # mixed lengths: a few very short and very long requests
        prefix[0], prefix[1] = 1, max_prefix
    slots = sum(prefix) + b * n + 64
    k_cache = torch.randn(slots, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(slots, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(slots, generator=g)  # scattered slots, as a paged pool hands them out
    req_to_token = torch.zeros(b + 5, max_prefix + n + 8, dtype=torch.int32)
    pool_idx = torch.randperm(b + 5, generator=g)[:b]
    used = 0
    for r, p in enumerate(prefix):
        req_to_token[pool_idx[r], : p + n] = perm[used : used + p + n].to(torch.int32)
        used += p + n
    q = torch.randn(b * n, hq, d, generator=g).to(dtype)
    return q, k_cache, v_cache, req_to_token, pool_idx, prefix


@pytest.mark.parametrize("seed,b,n", [(0, 1, 4), (1, 2, 4), (2, 5, 4), (3, 8, 2), (4, 16, 4), (5, 16, 6), (6, 3, 1)])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4)])
def test_chain_attention_equals_sglang_extend(seed, b, n, heads):
    hq, hkv = heads
    q, kc, vc, r2t, pool_idx, prefix = _case(seed, b, n, hq, hkv, 16, 300)
    scale = 0.25
    got = chain_verify_attention(q, torch.empty_like(q), kc, vc, r2t, pool_idx, prefix, n, scale, hq != hkv)
    want = _sglang_extend(q, kc, vc, r2t, pool_idx, prefix, n, scale, hq != hkv)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_chain_attention_bf16_close_to_fp32():
    q, kc, vc, r2t, pool_idx, prefix = _case(11, 6, 4, 9, 3, 32, 200)
    want = chain_verify_attention(q, torch.empty_like(q), kc, vc, r2t, pool_idx, prefix, 4, None, True)
    got = chain_verify_attention(q.bfloat16(), torch.empty_like(q.bfloat16()), kc.bfloat16(), vc.bfloat16(),
                                 r2t, pool_idx, prefix, 4, None, True)
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05)


def test_wrong_prefix_is_caught():
    """Negative control: one position off in the committed length changes the result."""
    q, kc, vc, r2t, pool_idx, prefix = _case(7, 4, 4, 4, 4, 16, 100)
    want = _sglang_extend(q, kc, vc, r2t, pool_idx, prefix, 4, None, False)
    shifted = [p + 1 for p in prefix]
    got = chain_verify_attention(q, torch.empty_like(q), kc, vc, r2t, pool_idx, shifted, 4, None, False)
    assert not torch.allclose(got, want, atol=1e-3)


def test_length_groups_bound_padding():
    lens = [5, 4000, 300, 310, 290, 4100, 7, 1000]
    groups = length_groups(lens)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    for g in groups:
        longest = max(lens[i] for i in g)
        assert lens[g[0]] == longest
        assert len(g) * longest <= 1.25 * sum(lens[i] for i in g) or len(g) == 1
    assert length_groups([100] * 16) == [list(range(16))]  # equal lengths: one call
