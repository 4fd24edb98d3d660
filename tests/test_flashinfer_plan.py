"""CPU tests of the GPU draft path's pure parts: bit packing, the FlashInfer planner, the paged KV
pool, CUDA-graph bucket/padding rules and backend selection.

The planner is checked two ways: structurally (indptrs, last page lengths, packed bytes round-trip
to the very masks tree.py builds), and semantically -- ``reference_paged_attention`` computes
attention from the plan alone, reading pages and mask bits the way FlashInfer's kernel documents it
(kv_len = (pages - 1) * P + last_page_len; request r's mask at byte packed_indptr[r], bit
qo * kv_len + kv, little bit order), and must equal the SDPA path on the real tree layout.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sglang_ssd.draft.attention import AttnSeq, BatchAttention
from sglang_ssd.draft.cuda_graphs import choose_bucket, default_buckets, pad_q_lens
from sglang_ssd.draft.flashinfer_attention import (packbits_little, plan_batch, segment_packbits_little,
                                                   select_backend, unpackbits_little)
from sglang_ssd.draft.kv_cache import RequestKV
from sglang_ssd.draft.paged_kv import PagedKVPool
from sglang_ssd.draft.runner import DraftRunner, ForwardItem, resolve_dtype
from sglang_ssd.draft.tree import (causal_mask, flatten_masks, fork_indices, tree_kv_len, tree_mask,
                                   tree_positions, tree_slots)
from tests.tiny_models import make_tiny_model

torch.set_num_threads(1)


# ------------------------------------------------------------------------------------- packing
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 100])
def test_packbits_little_matches_numpy(n):
    g = torch.Generator().manual_seed(n)
    bits = torch.rand(n, generator=g) < 0.5
    ours = packbits_little(bits)
    ref = np.packbits(bits.numpy().astype(np.uint8), bitorder="little")
    assert ours.dtype == torch.uint8 and ours.tolist() == ref.tolist()
    assert torch.equal(unpackbits_little(ours, n), bits)


def test_flashinfer_docstring_example_bit_order():
    # flashinfer.packbits / segment_packbits docs give "big" order; "little" is each byte bit-reversed
    x = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1], dtype=torch.bool)
    assert packbits_little(x).tolist() == [0b11001101]
    packed, indptr = segment_packbits_little(torch.tensor([1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1], dtype=torch.bool),
                                             torch.tensor([0, 4, 7, 11]))
    assert indptr.tolist() == [0, 1, 2, 3]  # every segment starts on its own byte
    big = [0b10110000, 0b00100000, 0b11010000]  # the segment_packbits docstring's output
    assert packed.tolist() == [int(f"{b:08b}"[::-1], 2) for b in big] == [0b1101, 0b100, 0b1011]


def _tree_blocks(prefixes, k, fans, depth):
    """The real tree layout: per request (prefix P, fan-out list) -> depth-`depth` mask block."""
    return [tree_mask(p, k, fork_indices(f), depth) for p, f in zip(prefixes, fans)]


@pytest.mark.parametrize("depth", [0, 2])
def test_segment_packing_round_trips_tree_masks(depth):
    k = 3
    blocks = _tree_blocks([5, 17, 1], k, [[2, 1, 0, 1], [1, 1, 1, 1], [3, 0, 0, 0]], depth)
    blocks.append(causal_mask(9, 4))  # an extend (glue / backup decode) in the same batch
    flat, indptr = flatten_masks(blocks)
    packed, pindptr = segment_packbits_little(flat, indptr)
    sizes = [b.numel() for b in blocks]
    assert pindptr.tolist() == [0] + np.cumsum([math.ceil(s / 8) for s in sizes]).tolist()
    for r, blk in enumerate(blocks):
        seg = packed[pindptr[r] : pindptr[r + 1]]
        assert torch.equal(unpackbits_little(seg, blk.numel()).view_as(blk), blk)


# ------------------------------------------------------------------------------------- planner
def _fi_mask_indptr(qo_indptr, kv_indptr, last, page):
    """flashinfer.prefill._compute_page_mask_indptr, re-stated: cumsum(q_len * kv_len)."""
    q = qo_indptr[1:] - qo_indptr[:-1]
    kv = (kv_indptr[1:] - kv_indptr[:-1] - 1) * page + last
    return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(q.long() * kv.long(), 0)])


@pytest.mark.parametrize("page", [1, 16])
def test_plan_batch_layout(page):
    pool = PagedKVPool(1, 1, 4, torch.float32, "cpu", page_size=page, num_pages=4)
    k = 2
    prefixes, fans = [5, 30, 1], [[1, 2, 0], [2, 0, 1], [1, 1, 1]]
    kvs = [pool.new_request(tree_kv_len(p, k, sum(f), k - 1)) for p, f in zip(prefixes, fans)]
    kvs[1].pages.reverse()  # non-contiguous, non-monotone page tables must work too
    slots = [tree_slots(p, k, sum(f), 1) for p, f in zip(prefixes, fans)]
    kv_lens = [tree_kv_len(p, k, sum(f), 1) for p, f in zip(prefixes, fans)]
    masks = _tree_blocks(prefixes, k, fans, 1)
    assert any(kl % page for kl in kv_lens) or page == 1
    plan = plan_batch([kv.pages for kv in kvs], slots, kv_lens, masks, page)
    assert plan.qo_indptr.tolist() == [0, 3, 6, 9]
    assert plan.kv_lens().tolist() == kv_lens
    assert all(1 <= x <= page for x in plan.last_page_len.tolist())
    for r, kv in enumerate(kvs):
        a, b = plan.kv_indptr[r].item(), plan.kv_indptr[r + 1].item()
        assert plan.kv_indices[a:b].tolist() == kv.pages[: math.ceil(kv_lens[r] / page)]
        assert torch.equal(plan.write_loc[plan.qo_indptr[r] : plan.qo_indptr[r + 1]], kv.locations(slots[r]))
    assert plan.mask_indptr.tolist() == _fi_mask_indptr(plan.qo_indptr, plan.kv_indptr, plan.last_page_len,
                                                        page).tolist()
    packed, packed_indptr = plan.packed()
    assert plan.packed_bytes == packed.numel() == packed_indptr[-1].item()  # the graph-buffer check's size
    for r, m in enumerate(masks):
        seg = packed[packed_indptr[r] : packed_indptr[r + 1]]
        assert torch.equal(unpackbits_little(seg, m.numel()).view_as(m), m)
    for dt in (plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.last_page_len, packed_indptr):
        assert dt.dtype == torch.int32


def test_plan_batch_rejects_short_tables_and_bad_masks():
    with pytest.raises(ValueError, match="does not cover"):
        plan_batch([[0]], [torch.tensor([0])], [17], [torch.ones(1, 17, dtype=torch.bool)], 16)
    with pytest.raises(ValueError, match="mask"):
        plan_batch([[0]], [torch.tensor([0])], [3], [torch.ones(2, 3, dtype=torch.bool)], 16)


def reference_paged_attention(plan, q, kpages, vpages):
    """Attention computed from the plan alone, the way FlashInfer's paged kernel reads it: the custom
    mask's bits, or for a causal plan its bottom-right rule (query i sees kv <= kv_len - q_len + i)."""
    page = plan.page_size
    packed, packed_indptr = plan.packed() if not plan.causal else (None, None)
    outs = []
    for r in range(len(plan.qo_indptr) - 1):
        q0, q1 = plan.qo_indptr[r].item(), plan.qo_indptr[r + 1].item()
        pages = plan.kv_indices[plan.kv_indptr[r] : plan.kv_indptr[r + 1]].long()
        kv_len = (len(pages) - 1) * page + plan.last_page_len[r].item()
        kk = kpages[pages].reshape(-1, *kpages.shape[2:])[:kv_len]   # [kv, Hkv, d]
        vv = vpages[pages].reshape(-1, *vpages.shape[2:])[:kv_len]
        if plan.causal:
            mask = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - (q1 - q0), kv_len)[:, None]
        else:
            mask = unpackbits_little(packed[packed_indptr[r] :], (q1 - q0) * kv_len).view(q1 - q0, kv_len)
        qq = q[q0:q1]                                                # [q, H, d]
        rep = qq.shape[1] // kk.shape[1]
        kk, vv = kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", qq, kk) / math.sqrt(qq.shape[-1])
        s = s.masked_fill(~mask[None], float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vv))
    return torch.cat(outs)


@pytest.mark.parametrize("page", [1, 16])
def test_plan_semantics_equal_sdpa_on_tree_layout(page):
    torch.manual_seed(0)
    layers, hkv, h, d, k = 1, 2, 4, 8, 3
    pool = PagedKVPool(layers, hkv, d, torch.float64, "cpu", page_size=page, num_pages=2)
    prefixes, fans = [6, 21, 2], [[2, 1, 0, 1], [1, 0, 2, 0], [1, 1, 1, 1]]
    seqs = []
    for p, f in zip(prefixes, fans):
        b, depth = sum(f), 2
        kv = pool.new_request(tree_kv_len(p, k, b, depth))
        # history (prefix + glue + earlier depths) with random K/V
        hist = torch.arange(tree_kv_len(p, k, b, depth - 1))
        kv.write(0, hist, torch.randn(len(hist), hkv, d, dtype=torch.float64),
                 torch.randn(len(hist), hkv, d, dtype=torch.float64))
        seqs.append(AttnSeq(kv, tree_slots(p, k, b, depth), tree_kv_len(p, k, b, depth),
                            tree_mask(p, k, fork_indices(f), depth)))
    t = sum(len(s.slots) for s in seqs)
    q = torch.randn(t, h, d, dtype=torch.float64)
    kn, vn = torch.randn(t, hkv, d, dtype=torch.float64), torch.randn(t, hkv, d, dtype=torch.float64)
    ref = BatchAttention(seqs, torch.device("cpu"))(0, q, kn, vn)       # SDPA (writes kn, vn)
    plan = plan_batch([s.kv.pages for s in seqs], [s.slots for s in seqs], [s.kv_len for s in seqs],
                      [s.mask for s in seqs], page)
    out = reference_paged_attention(plan, q, pool.k[0], pool.v[0])
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)


# ------------------------------------------------------------------------------------ paged KV
def test_paged_runner_equals_contiguous_runner_through_a_tree_build():
    path = make_tiny_model()
    plain = DraftRunner.from_dir(path)
    paged = DraftRunner.from_dir(path)
    c = paged.cfg
    paged.pool = PagedKVPool(c.num_layers, c.num_kv_heads, c.head_dim, paged.dtype, "cpu", page_size=4, num_pages=2)
    torch.manual_seed(3)
    k, prompts, fans = 2, [torch.randint(0, 96, (n,)).tolist() for n in (7, 12)], [[1, 2, 1], [2, 0, 1]]
    outs = {}
    for name, runner in (("plain", plain), ("paged", paged)):
        kvs = [runner.new_kv(4) for _ in prompts]
        res = runner.forward([ForwardItem.extend(kv, p, 0, 2) for kv, p in zip(kvs, prompts)])
        glue = runner.forward([ForwardItem.extend(kv, [5, 6, 7], len(p), 3) for kv, p in zip(kvs, prompts)])
        res += glue
        x = [torch.arange(sum(f)) % 96 for f in fans]
        for depth in range(k):
            items = []
            for kv, p, f, xi in zip(kvs, prompts, fans, x):
                pr, forks = len(p), fork_indices(f)  # glue [root, s1, s2] sits at slots P..P+K, P = len(p)
                items.append(ForwardItem(kv, xi, tree_positions(pr, forks, depth), tree_slots(pr, k, len(forks), depth),
                                         tree_kv_len(pr, k, len(forks), depth), tree_mask(pr, k, forks, depth),
                                         len(forks)))
            step = runner.forward(items)
            res += step
            x = [s.argmax(-1) for s in step]
        outs[name] = res
    assert isinstance(paged.new_kv(), type(paged.pool.new_request()))
    for a, b in zip(outs["plain"], outs["paged"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_pool_pages_return_on_release_and_growth_bumps_generation():
    pool = PagedKVPool(2, 1, 4, torch.float32, "cpu", page_size=4, num_pages=2)
    a = pool.new_request(8)
    a.write(1, torch.tensor([0, 5]), torch.ones(2, 1, 4), torch.full((2, 1, 4), 2.0))
    b = pool.new_request(5)  # needs 2 more pages: the pool doubles
    assert pool.generation == 1 and pool.num_pages == 4 and pool.used_pages == 4
    kk, vv = a.view(1, 6)  # data survived the reallocation
    assert kk[0, 0].tolist() == [1.0] * 4 and vv[0, 5].tolist() == [2.0] * 4 and kk[0, 1].abs().sum() == 0
    b.free()
    assert pool.used_pages == 2
    del a
    assert pool.used_pages == 0 and sorted(pool.free) == [0, 1, 2, 3]


def test_request_kv_and_paged_kv_agree_on_view():
    torch.manual_seed(1)
    pool = PagedKVPool(1, 2, 3, torch.float32, "cpu", page_size=3, num_pages=1)
    pk, rk = pool.new_request(10), RequestKV(1, 2, 3, torch.float32, "cpu", 10)
    slots = torch.tensor([9, 0, 4, 3, 7])
    kk, vv = torch.randn(5, 2, 3), torch.randn(5, 2, 3)
    pk.write(0, slots, kk, vv)
    rk.write(0, slots, kk, vv)
    for x, y in zip(pk.view(0, 10), rk.view(0, 10)):
        assert torch.equal(x, y)


# ------------------------------------------------------------------------- CUDA-graph buckets
def test_default_buckets():
    assert default_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert default_buckets(300) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256, 300]
    assert default_buckets(5) == [1, 2, 4, 5]


@pytest.mark.parametrize("n_req,n_tok", [(1, 1), (1, 5), (3, 3), (3, 17), (4, 64), (5, 40), (16, 16)])
def test_choose_bucket_fits_and_pads(n_req, n_tok):
    reqs, toks = default_buckets(16), default_buckets(64)
    nb, tb = choose_bucket(n_req, n_tok, reqs, toks)
    pads = pad_q_lens([1] * (n_req - 1) + [n_tok - n_req + 1], nb, tb)
    assert nb >= n_req and tb >= n_tok
    assert len(pads) == nb - n_req and sum(pads) == tb - n_tok and all(p >= 1 for p in pads)
    # minimal: no smaller requests bucket admits a valid padding
    for nb2 in reqs:
        if n_req <= nb2 < nb:
            t_ok = [t for t in toks if t >= n_tok + (nb2 - n_req) and not (t > n_tok and nb2 == n_req)]
            assert not t_ok


def test_choose_bucket_none_when_too_big_and_exact_fit_needs_no_pad():
    assert choose_bucket(2, 65, default_buckets(16), default_buckets(64)) is None
    assert choose_bucket(17, 20, default_buckets(16), default_buckets(64)) is None
    assert choose_bucket(4, 32, [4, 8], [32, 64]) == (4, 32)
    assert pad_q_lens([8] * 4, 4, 32) == []
    assert choose_bucket(4, 30, [4, 8], [32, 64]) == (8, 64)  # 2 pad tokens need a pad request
    with pytest.raises(ValueError):
        pad_q_lens([3, 3], 2, 8)
    with pytest.raises(ValueError):
        choose_bucket(3, 2, [4], [4])


# ----------------------------------------------------------------------------- backend choice
def test_select_backend_and_dtype_on_cpu():
    assert select_backend("cpu") == "sdpa"
    assert select_backend("cpu", "sdpa") == "sdpa"
    with pytest.raises(ValueError, match="CUDA"):
        select_backend("cpu", "flashinfer")
    with pytest.raises(ValueError):
        select_backend("cpu", "xformers")
    assert select_backend("cuda:0", "auto", torch.float32) == "sdpa"  # fp32 draft: no FlashInfer
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda:1") == torch.bfloat16
    assert resolve_dtype("float16", "cpu") == torch.float16
    runner = DraftRunner.from_dir(make_tiny_model())
    assert runner.backend == "sdpa" and runner.pool is None and runner.graphs is None
