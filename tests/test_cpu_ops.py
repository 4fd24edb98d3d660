"""Each pure-torch sgl_kernel stand-in op against a plain-Python reference on random inputs."""


import pytest
import torch

from sglang_ssd.cpu import ops


def _spans(gen, bs, width):
    start = torch.randint(0, width // 2, (bs,), generator=gen)
    end = start + torch.randint(0, width // 2, (bs,), generator=gen)
    return start, end


@pytest.mark.parametrize("seed", range(5))
def test_assign_req_to_token_pool(seed):
    g = torch.Generator().manual_seed(seed)
    pool, width, bs = 9, 40, 5
    req_to_token = torch.randint(0, 1000, (pool, width), generator=g, dtype=torch.int32)
    idx = torch.randperm(pool, generator=g)[:bs]
    start, end = _spans(g, bs, width)
    total = int((end - start).sum())
    locs = torch.randint(0, 10_000, (total + 3,), generator=g)  # trailing entries must be ignored
    expect = req_to_token.clone()
    pos = 0
    for b in range(bs):
        for c in range(int(start[b]), int(end[b])):
            expect[idx[b], c] = int(locs[pos])
            pos += 1
    ops.assign_req_to_token_pool_cpu(idx, req_to_token, start, end, locs, width)
    assert torch.equal(req_to_token, expect)


@pytest.mark.parametrize("seed", range(5))
def test_assign_extend_cache_locs(seed):
    g = torch.Generator().manual_seed(seed)
    pool, width, bs = 7, 32, 4
    req_to_token = torch.randint(0, 1000, (pool, width), generator=g, dtype=torch.int32)
    idx = torch.randint(0, pool, (bs,), generator=g)
    start, end = _spans(g, bs, width)
    out = torch.full((int((end - start).sum()) + 2,), -7, dtype=torch.int64)
    expect = out.clone()
    pos = 0
    for b in range(bs):
        for c in range(int(start[b]), int(end[b])):
            expect[pos] = int(req_to_token[idx[b], c])
            pos += 1
    ops.assign_extend_cache_locs_cpu(idx, req_to_token, start, end, out, width)
    assert torch.equal(out, expect)


@pytest.mark.parametrize("seed", range(5))
def test_fill_bonus_tokens(seed):
    g = torch.Generator().manual_seed(seed)
    bs, stride = 6, 5
    tokens = torch.randint(0, 100, (bs * stride,), generator=g)
    lens = torch.randint(1, stride + 1, (bs,), generator=g, dtype=torch.int32)
    bonus = torch.zeros(bs, dtype=torch.int64)
    ops.fill_bonus_tokens_cpu(tokens, lens, bonus, stride)
    assert bonus.tolist() == [int(tokens[b * stride + int(lens[b]) - 1]) for b in range(bs)]


@pytest.mark.parametrize("seed", range(5))
def test_fill_accept_out_cache_loc(seed):
    g = torch.Generator().manual_seed(seed)
    index = torch.randint(-1, 20, (4, 5), generator=g)
    locs = torch.randint(0, 1000, (20,), generator=g)
    out = torch.full((20,), -1, dtype=torch.int64)
    ops.fill_accept_out_cache_loc_cpu(index, locs, out)
    expect = [int(locs[i]) for i in index.reshape(-1).tolist() if i != -1]
    assert out[: len(expect)].tolist() == expect
    assert (out[len(expect):] == -1).all()


@pytest.mark.parametrize("seed", range(5))
def test_copy_all_layer_kv_cache(seed):
    g = torch.Generator().manual_seed(seed)
    rows = 30
    buffers = [torch.randn(rows, 3, 4, generator=g), torch.randn(rows, 8, generator=g).to(torch.bfloat16)]
    ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b[0].numel() * b.element_size() for b in buffers], dtype=torch.int64)
    # overlapping source/target sets: the op must read every source row before writing
    src = torch.randperm(rows, generator=g)[:10]
    tgt = torch.cat([src[5:], torch.randperm(rows, generator=g)[:5]])
    expect = [b.clone() for b in buffers]
    for e in expect:
        snapshot = e.clone()
        for s, t in zip(src.tolist(), tgt.tolist()):
            e[t] = snapshot[s]
    ops.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, e in zip(buffers, expect):
        assert torch.equal(b, e)


def test_standin_placeholder_names_the_op():
    import sgl_kernel

    assert getattr(sgl_kernel, "IS_STANDIN", False)
    assert sgl_kernel.assign_req_to_token_pool_cpu is ops.assign_req_to_token_pool_cpu
    with pytest.raises(NotImplementedError, match="extend_attention_cpu"):
        sgl_kernel.extend_attention_cpu()
    from sgl_kernel.speculative import reconstruct_indices_from_tree_mask

    with pytest.raises(NotImplementedError, match="reconstruct_indices_from_tree_mask"):
        reconstruct_indices_from_tree_mask()
    with pytest.raises(ModuleNotFoundError):
        import sgl_kernel.flash_attn  # noqa: F401
