"""q must be bit-identical at both ends: the draft dequantises its float16 rows over its head's ids
([K, W], its device), the verifier the same bytes scattered over the vocabulary ([K, V], zeros
elsewhere, the target's device).  dequantize_proposal's normaliser is the exact sum of the values, so
layout, permutation and reduction order cannot move a bit (sglang_ssd/saguaro/proposal.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sglang_ssd.saguaro.proposal import dequantize_proposal, quantize_proposal

V, W = 49152, 8192
TINY = 2.0 ** -24  # the smallest positive float16 (subnormal): 1 unit of every float16 probability


def adversarial_row() -> torch.Tensor:
    """Mass above 1 after rounding plus many 1-unit entries: a float32 running sum past 1 (ulp 2^-23)
    drops a half-ulp addend or not depending on when it comes."""
    return torch.tensor([0.75, 0.5] + [TINY] * 513 + [0.0] * 7, dtype=torch.float16)


def sequential_f32_sum(values: np.ndarray) -> np.float32:
    acc = np.float32(0.0)
    for x in values.astype(np.float32):
        acc = np.float32(acc + x)
    return acc


def test_float32_running_sums_depend_on_order():
    """Negative control: the property below is not free.  A float32 normaliser summed in two orders
    (both legitimate reduction orders of some device / layout) disagrees, and neither is exact."""
    row = adversarial_row().numpy()
    exact = math.fsum(float(x) for x in row)
    fwd, bwd = sequential_f32_sum(row), sequential_f32_sum(row[::-1])
    assert fwd != bwd
    assert float(fwd) != exact or float(bwd) != exact
    # ... and the q bits they give differ
    assert not np.array_equal(row.astype(np.float32) / fwd, row.astype(np.float32) / bwd)


def test_normaliser_is_the_exact_sum():
    g = torch.Generator().manual_seed(1)
    rows = [adversarial_row(), quantize_proposal(torch.softmax(torch.randn(W, generator=g) * 4, -1)),
            torch.full((V,), 1.0 / V, dtype=torch.float16)]  # a fast backup's uniform row
    for row in rows:
        q = dequantize_proposal(row)
        s = np.float32(math.fsum(float(x) for x in row.numpy()))  # exact, then rounded once
        assert torch.equal(q, row.float() / torch.tensor(s))


@pytest.mark.parametrize("seed", range(4))
def test_compact_scattered_and_permuted_rows_give_identical_bits(seed):
    g = torch.Generator().manual_seed(seed)
    k = 3
    logits = torch.randn(k, W, generator=g) * (1 + seed)
    q16 = quantize_proposal(torch.softmax(logits, -1))
    q16[0, : adversarial_row().numel()] = adversarial_row()  # one row with mass > 1 and 1-unit tails
    ids = torch.randperm(V, generator=g)[:W].sort().values  # the head's ids (SpecReply.q_ids)
    dense = torch.zeros(k, V, dtype=torch.float16).index_copy_(1, ids, q16)
    compact = dequantize_proposal(q16)  # the draft's copy
    verifier = dequantize_proposal(dense)  # the worker's copy
    assert torch.equal(verifier[:, ids], compact)
    assert not verifier.index_fill(1, ids, 0).any()
    perm = torch.randperm(W, generator=g)
    assert torch.equal(dequantize_proposal(q16[:, perm]), compact[:, perm])
    # a batch [bs, K, V] with a greedy (all-zero) row stays 0 there and equal elsewhere
    batch = torch.stack([dense, torch.zeros_like(dense)])
    out = dequantize_proposal(batch)
    assert torch.equal(out[0], verifier) and not out[1].any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cpu_and_cuda_give_identical_bits():
    g = torch.Generator().manual_seed(7)
    q16 = quantize_proposal(torch.softmax(torch.randn(4, 3, W, generator=g) * 3, -1))
    q16[0, 0, : adversarial_row().numel()] = adversarial_row()
    assert torch.equal(dequantize_proposal(q16.cuda()).cpu(), dequantize_proposal(q16))


def test_worker_assembly_scatters_wire_rows_on_the_device():
    """DraftLink's reply_q16: sparse rows [m, K, W] over q_ids -> [bs, K, V], zeros on rows without q;
    the same values as the protocol's host scatter; bad shapes or ids are errors (the round then falls
    back to target-only decoding, tests/test_draft_link_faults.py)."""
    from sglang_ssd.protocol import SpecReply
    from sglang_ssd.sglang.link_state import reply_q16

    rng = np.random.default_rng(3)
    ids = np.array([1, 4, 5, 10], dtype=np.int64)
    q = rng.random((2, 3, 4)).astype(np.float16)
    reply = SpecReply(round_id=1, tokens=np.zeros((3, 3)), hit=np.zeros(3, bool), q_rows=np.array([0, 2]), q=q,
                      q_ids=ids)
    rows = torch.as_tensor(reply.q_rows)
    out = reply_q16(reply.q, reply.q_ids, rows, 3, 3, 12, "cpu")
    assert out.dtype == torch.float16 and out.shape == (3, 3, 12)
    assert torch.equal(out[rows], torch.from_numpy(reply.q_dense(12))) and not out[1].any()
    dense = reply_q16(reply.q_dense(12), np.zeros(0, dtype=np.int64), rows, 3, 3, 12, "cpu")
    assert torch.equal(dense, out)
    with pytest.raises(ValueError, match="shape"):
        reply_q16(q[:, :2], ids, rows, 3, 3, 12, "cpu")
    with pytest.raises(ValueError, match="vocab size"):
        reply_q16(q, ids, rows, 3, 3, 10, "cpu")
