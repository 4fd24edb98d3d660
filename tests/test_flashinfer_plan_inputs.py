"""CPU tests of what the draft hands FlashInfer's plan() (review finding 8): host int32 indptrs,
no mask and causal=True for all-extend batches, a mask only where one is needed.

``plan_wrapper`` is checked with a recording stand-in for BatchPrefillWithPagedKVCacheWrapper:
flashinfer cannot run on a CPU machine, and what matters here is exactly what is passed to it.
The semantics of a causal plan are checked against SDPA with the kernel's own causal rule."""

from __future__ import annotations

import torch

from sglang_ssd.draft.attention import AttnSeq, BatchAttention
from sglang_ssd.draft.flashinfer_attention import FlashInferAttention, plan_batch, plan_wrapper
from sglang_ssd.draft.paged_kv import PagedKVPool
from sglang_ssd.draft.runner import ForwardItem
from sglang_ssd.draft.tree import causal_mask, flatten_masks, fork_indices, tree_kv_len, tree_mask, tree_slots
from tests.test_flashinfer_plan import reference_paged_attention

torch.set_num_threads(1)


class RecordingWrapper:
    """Stands in for flashinfer's wrapper: keeps the arguments of the last plan()."""

    def plan(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


def _extend_seqs(pool, starts_and_lens):
    seqs = []
    for start, q in starts_and_lens:
        it = ForwardItem.extend(pool.new_request(start + q), list(range(q)), start)
        assert it.mask is None  # an extend builds no [q, kv] block up front
        seqs.append(AttnSeq(it.kv, it.slots, it.kv_len, it.mask))
    return seqs


def _plan(seqs, page, need_mask=False):
    return plan_batch([s.kv.pages for s in seqs], [s.slots for s in seqs], [s.kv_len for s in seqs],
                      [s.mask for s in seqs], page, need_mask=need_mask)


def test_all_extend_batch_plans_causal_without_a_mask():
    pool = PagedKVPool(1, 1, 4, torch.float32, "cpu", page_size=4, num_pages=8)
    seqs = _extend_seqs(pool, [(0, 9), (5, 3), (2, 1)])
    plan = _plan(seqs, 4)
    assert plan.causal and plan.custom_mask is None and plan.mask_indptr is None
    assert plan.packed_bytes == sum(-(-(q * kl) // 8) for q, kl in [(9, 9), (3, 8), (1, 3)])
    for t in (plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.last_page_len):
        assert t.device.type == "cpu" and t.dtype == torch.int32
    # a graph needs the mask anyway: the causal blocks, exactly as tree.causal_mask builds them
    graphed = _plan(seqs, 4, need_mask=True)
    assert not graphed.causal
    flat, indptr = flatten_masks([causal_mask(0, 9), causal_mask(5, 3), causal_mask(2, 1)])
    assert torch.equal(graphed.custom_mask, flat) and torch.equal(graphed.mask_indptr, indptr)


def test_mixed_batch_builds_the_extends_masks():
    pool = PagedKVPool(1, 1, 4, torch.float32, "cpu", page_size=4, num_pages=8)
    p, k, forks = 6, 2, fork_indices([1, 2, 0])
    tree = AttnSeq(pool.new_request(20), tree_slots(p, k, 3, 1), tree_kv_len(p, k, 3, 1), tree_mask(p, k, forks, 1))
    ext = _extend_seqs(pool, [(4, 2)])[0]
    plan = _plan([tree, ext], 4)
    flat, _ = flatten_masks([tree.mask, causal_mask(4, 2)])
    assert not plan.causal and torch.equal(plan.custom_mask, flat)


def test_mask_none_must_be_a_causal_extend():
    pool = PagedKVPool(1, 1, 4, torch.float32, "cpu", page_size=4, num_pages=2)
    kv = pool.new_request(8)
    for slots, kv_len in ((torch.tensor([3, 5]), 6), (torch.tensor([4, 5]), 7)):
        try:
            plan_batch([kv.pages], [slots], [kv_len], [None], 4)
        except ValueError as exc:
            assert "causal extend" in str(exc)
        else:
            raise AssertionError(f"slots {slots.tolist()} / kv_len {kv_len} accepted as a causal extend")


def test_causal_plan_semantics_equal_sdpa():
    torch.manual_seed(0)
    hkv, h, d, page = 2, 4, 8, 4
    pool = PagedKVPool(1, hkv, d, torch.float64, "cpu", page_size=page, num_pages=2)
    seqs = _extend_seqs(pool, [(0, 7), (6, 3), (13, 1)])
    for s in seqs:  # history before each extend
        start = s.kv_len - len(s.slots)
        if start:
            s.kv.write(0, torch.arange(start), torch.randn(start, hkv, d, dtype=torch.float64),
                       torch.randn(start, hkv, d, dtype=torch.float64))
    t = sum(len(s.slots) for s in seqs)
    q = torch.randn(t, h, d, dtype=torch.float64)
    kn, vn = torch.randn(t, hkv, d, dtype=torch.float64), torch.randn(t, hkv, d, dtype=torch.float64)
    ref = BatchAttention(seqs, torch.device("cpu"))(0, q, kn, vn)
    plan = _plan(seqs, page)
    assert plan.causal
    torch.testing.assert_close(reference_paged_attention(plan, q, pool.k[0], pool.v[0]), ref, atol=1e-10, rtol=1e-10)


def test_plan_wrapper_passes_host_int32_indptrs_and_a_mask_only_when_needed():
    pool = PagedKVPool(2, 2, 8, torch.bfloat16, "cpu", page_size=4, num_pages=8)
    rec = RecordingWrapper()
    causal = _extend_seqs(pool, [(0, 5), (3, 2)])
    attn = FlashInferAttention(causal, pool, None, 4, torch.bfloat16, wrapper=rec)
    qo, kv_ptr, kv_idx, last, hq, hkv, hd, page = rec.args
    for t in (qo, kv_ptr, last):  # plan() reads these on the host: passing them there costs no sync
        assert t.device.type == "cpu" and t.dtype == torch.int32
    assert kv_idx.dtype == torch.int32 and kv_idx.device == pool.device
    assert (hq, hkv, hd, page) == (4, 2, 8, 4)
    assert qo.tolist() == [0, 5, 7] and last.tolist() == [1, 1]
    assert rec.kwargs["custom_mask"] is None and rec.kwargs["causal"] is True
    assert rec.kwargs["q_data_type"] == rec.kwargs["kv_data_type"] == torch.bfloat16
    assert attn.write_loc.tolist() == attn.plan.write_loc.tolist()

    p, k, forks = 3, 1, fork_indices([2, 1])
    tree = AttnSeq(pool.new_request(12), tree_slots(p, k, 3, 0), tree_kv_len(p, k, 3, 0), tree_mask(p, k, forks, 0))
    plan = plan_batch([tree.kv.pages, causal[1].kv.pages], [tree.slots, causal[1].slots],
                      [tree.kv_len, causal[1].kv_len], [tree.mask, None], 4)
    plan_wrapper(rec, plan, pool.device, 4, 2, 8, torch.bfloat16, torch.bfloat16)
    mask = rec.kwargs["custom_mask"]
    assert rec.kwargs["causal"] is False and mask.dtype == torch.bool and mask.device == pool.device
    assert mask.numel() == tree.mask.numel() + causal_mask(3, 2).numel()
