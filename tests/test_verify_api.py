"""Greedy paths and API edge cases of chain verification (sglang_ssd.saguaro.verify): greedy rows against a loop
reference (caps, ties, no randomness), forced stops drawing from p, padding, fp16 wire q, mixed batches of
greedy / sampled / deterministic rows, the inverse-CDF sampler and the all-greedy fast path.  The exact and
statistical checks of sampled rows are tests/test_verify.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sglang_ssd.saguaro.verify as verify
from sglang_ssd.saguaro.proposal import dequantize_proposal, quantize_proposal
from sglang_ssd.saguaro.verify import PAD_TOKEN, verify_chain
from tests.test_verify import N, draw_chains, extend_and_count, g_test_pvalue, joint_vector, make_tables


def greedy_reference(argmax: torch.Tensor, drafts: torch.Tensor, cap: torch.Tensor):
    lens, out = [], torch.full((drafts.shape[0], drafts.shape[1] + 1), PAD_TOKEN)
    for b in range(drafts.shape[0]):
        n = 0
        while n < cap[b] and drafts[b, n] == argmax[b, n]:
            out[b, n] = drafts[b, n]
            n += 1
        out[b, n] = argmax[b, n]
        lens.append(n + 1)
    return torch.tensor(lens, dtype=torch.int32), out


@pytest.mark.parametrize("use_cap", [False, True])
def test_greedy_matches_loop_reference(use_cap):
    g = torch.Generator().manual_seed(0)
    b, k, v = 300, 4, 6
    p = torch.softmax(2 * torch.randn(b, k + 1, v, generator=g), -1)
    am = p.argmax(-1)
    drafts = torch.where(torch.rand(b, k, generator=g) < 0.25, torch.randint(0, v, (b, k), generator=g), am[:, :k])
    cap = torch.randint(0, k + 1, (b,), generator=g) if use_cap else torch.full((b,), k)
    lens, out = verify_chain(p, drafts, None, torch.ones(b, dtype=torch.bool), generator=g,
                             max_accept=cap if use_cap else None)
    ref_lens, ref_out = greedy_reference(am, drafts, cap)
    assert lens.dtype == torch.int32 and out.dtype == torch.long
    assert torch.equal(lens, ref_lens) and torch.equal(out, ref_out)
    # greedy rows use no randomness and ignore q
    q = torch.softmax(torch.randn(b, k, v, generator=g), -1)
    lens2, out2 = verify_chain(p, drafts, q, torch.ones(b, dtype=torch.bool),
                               generator=torch.Generator().manual_seed(99), max_accept=cap if use_cap else None)
    assert torch.equal(lens2, lens) and torch.equal(out2, out)


def test_greedy_uses_target_argmax_for_ties():
    p = torch.full((1, 3, 4), 0.25)  # everything tied
    logits_argmax = torch.tensor([[2, 3, 1]])  # what the caller computed from raw logits
    lens, out = verify_chain(p, torch.tensor([[2, 3]]), None, torch.tensor([True]), logits_argmax)
    assert lens.tolist() == [3] and out.tolist() == [[2, 3, 1]]
    lens, out = verify_chain(p, torch.tensor([[2, 3]]), None, torch.tensor([True]))  # argmax p -> 0
    assert lens.tolist() == [1] and out.tolist() == [[0, PAD_TOKEN, PAD_TOKEN]]


def test_forced_stop_draws_from_p_not_residual():
    # q one-hot at token 0, p = (.5, .5): a rejection could never emit 0, a forced stop must (half the time).
    n = 20_000
    p = torch.tensor([0.5, 0.5, 0.0]).expand(n, 3, 3).contiguous()
    drafts = torch.tensor([[0, PAD_TOKEN]]).expand(n, 2)  # short padded draft
    g = torch.Generator().manual_seed(0)
    lens, out = verify_chain(p, drafts, None, torch.zeros(n, dtype=torch.bool),
                             generator=g, max_accept=torch.zeros(n, dtype=torch.long))
    assert (lens == 1).all()
    assert g_test_pvalue(torch.bincount(out[:, 0], minlength=3), p[0, 0].double()) > 1e-4
    lens, out = verify_chain(p, drafts, None, torch.zeros(n, dtype=torch.bool), generator=g,
                             max_accept=torch.ones(n, dtype=torch.long))  # padded slot never read
    assert set(lens.tolist()) == {1, 2}
    assert ((out[:, 0] == 1) == (lens == 1)).all()  # a real rejection emits the residual: token 1
    assert g_test_pvalue(torch.bincount(out[lens == 2, 1], minlength=3), p[0, 1].double()) > 1e-4
    # -1 padding without max_accept is a forced stop too
    g2 = torch.Generator().manual_seed(0)
    lens2, out2 = verify_chain(p, drafts, None, torch.zeros(n, dtype=torch.bool), generator=g2,
                               max_accept=torch.ones(n, dtype=torch.long))
    g2 = torch.Generator().manual_seed(0)
    lens3, out3 = verify_chain(p, drafts, None, torch.zeros(n, dtype=torch.bool), generator=g2)
    assert torch.equal(lens2, lens3) and torch.equal(out2, out3)


def test_all_accepted_when_q_equals_p_and_padding():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(64, 4, 7, generator=g), -1)
    q = p[:, :3].clone()
    drafts = torch.multinomial(q.reshape(-1, 7), 1, generator=g).view(64, 3)
    lens, out = verify_chain(p, drafts, q, torch.zeros(64, dtype=torch.bool), generator=g)
    assert (lens == 4).all() and torch.equal(out[:, :3], drafts)
    cap = torch.arange(64) % 4
    lens, out = verify_chain(p, drafts, q, torch.zeros(64, dtype=torch.bool), generator=g, max_accept=cap)
    assert torch.equal(lens, (cap + 1).int())
    col = torch.arange(4).view(1, -1)
    assert (out[col > cap.view(-1, 1)] == PAD_TOKEN).all() and (out[col <= cap.view(-1, 1)] >= 0).all()


def test_float16_wire_q_is_dequantized():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(32, 4, 50, generator=g), -1)
    q16 = quantize_proposal(torch.softmax(torch.randn(32, 3, 50, generator=g), -1))
    drafts = torch.multinomial(dequantize_proposal(q16).reshape(-1, 50), 1, generator=g).view(32, 3)
    greedy = torch.zeros(32, dtype=torch.bool)
    a = verify_chain(p, drafts, q16, greedy, generator=torch.Generator().manual_seed(5))
    b = verify_chain(p, drafts, dequantize_proposal(q16), greedy, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_mixed_batch():
    """Greedy rows, rows with q and deterministic rows (q_valid False, garbage q) in one call."""
    v, k = 4, 2
    p, q = make_tables(v, k, "dense", seed=21)
    _, q_det = make_tables(v, k, "one_hot", seed=22)
    g = torch.Generator().manual_seed(0)
    pa, da, qa = draw_chains(p, q, k, v, N, g)
    pb, db, _ = draw_chains(p, q_det, k, v, N, g)
    pc, dc, qc = draw_chains(p, q, k, v, 300, g)
    qb = torch.full_like(qa, 1.0 / v)  # garbage: must be ignored for q_valid == False rows
    perm = torch.randperm(2 * N + 300, generator=g)
    cat = lambda *xs: torch.cat(xs)[perm]  # noqa: E731
    greedy = cat(torch.zeros(2 * N, dtype=torch.bool), torch.ones(300, dtype=torch.bool))
    q_valid = cat(torch.ones(N, dtype=torch.bool), torch.zeros(N, dtype=torch.bool), torch.ones(300, dtype=torch.bool))
    lens, out = verify_chain(cat(pa, pb, pc), cat(da, db, dc), cat(qa, qb, qc), greedy,
                             generator=g, q_valid=q_valid)
    inv = torch.argsort(perm)
    lens, out = lens[inv], out[inv]
    joint = joint_vector(p, k, v)
    assert g_test_pvalue(extend_and_count(out[:N], lens[:N], p, v, g), joint) > 1e-4
    assert g_test_pvalue(extend_and_count(out[N:2 * N], lens[N:2 * N], p, v, g), joint) > 1e-4
    ref_lens, ref_out = greedy_reference(pc.argmax(-1), dc, torch.full((300,), k))
    assert torch.equal(lens[2 * N:], ref_lens) and torch.equal(out[2 * N:], ref_out)


def test_sample_inverse_cdf_law_zeros_and_rounding_edge(monkeypatch):
    """The draft's sampler: frequencies match probs (G-test), zero-probability tokens are never drawn,
    unnormalised rows work, and a uniform that rounds u * total up to total still lands on a token with
    mass (the last one), never past the row or on a zero."""
    from scipy.stats import chi2

    g = torch.Generator().manual_seed(7)
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.2, 0.3, 0.0], [2.0, 0.0, 1.0, 0.0, 0.0, 1.0]])  # row 2 unnormalised
    n = 40000
    draws = verify.sample_inverse_cdf(probs.repeat(n, 1), g).view(n, 2)
    for row in range(2):
        want = probs[row] / probs[row].sum()
        counts = torch.bincount(draws[:, row], minlength=6).double()
        assert counts[want == 0].sum() == 0
        obs, exp = counts[want > 0], n * want[want > 0].double()
        gstat = 2 * (obs * (obs / exp).log()).sum().item()
        assert chi2.sf(gstat, int((want > 0).sum()) - 1) > 1e-4
    real_rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **kw: torch.ones_like(real_rand(*a, **kw)))  # u = 1
    assert verify.sample_inverse_cdf(probs, g).tolist() == [4, 5]


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), b=st.integers(1, 9), k=st.integers(1, 6), v=st.integers(2, 7),
       capped=st.booleans(), padded=st.booleans())
def test_greedy_fast_path_equals_verify_chain(seed, b, k, v, capped, padded):
    """verify_chain_greedy (the worker's all-greedy rounds) == verify_chain with every row greedy,
    including ties in the logits (argmax given), max_accept caps and -1 padding of short drafts."""
    from sglang_ssd.saguaro.verify import verify_chain_greedy

    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, 3, (b, k + 1, v), generator=g).float()  # small ints: many ties
    argmax = logits.argmax(-1)
    drafts = torch.where(torch.rand(b, k, generator=g) < 0.6, argmax[:, :k], torch.randint(0, v, (b, k), generator=g))
    if padded:
        cut = torch.randint(0, k + 1, (b,), generator=g)
        drafts = torch.where(torch.arange(k)[None] >= cut[:, None], torch.full_like(drafts, -1), drafts)
    cap = torch.randint(0, k + 1, (b,), generator=g) if capped else None
    p = torch.softmax(logits, -1)
    want = verify_chain(p, drafts, None, torch.ones(b, dtype=torch.bool), target_argmax=argmax,
                        generator=torch.Generator().manual_seed(0), max_accept=cap)
    got = verify_chain_greedy(drafts, argmax, v, max_accept=cap)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
