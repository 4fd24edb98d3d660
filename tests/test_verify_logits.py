"""verify_chain_logits: the worker's verify for plain-temperature rows, p computed only where read.

Same checks as test_verify.py's statistical suite (G-test of the K+1-token law against the target
joint, with negative controls the test must catch), fed logits instead of a p table: logits = T log p
with temperature T, so softmax(logits / T) is the table's p (zeros become -inf, as a grammar mask
writes them).  Plus: the accept decisions equal verify_chain's on the same uniforms, greedy rows equal
the loop reference, and the float16 wire q is read bit-identically to dequantize_proposal.
"""

from __future__ import annotations

import pytest
import torch

import sglang_ssd.saguaro.verify as verify
from sglang_ssd.saguaro.proposal import dequantize_proposal, quantize_proposal
from sglang_ssd.saguaro.verify import verify_chain, verify_chain_logits
from tests.test_verify import N, draw_chains, extend_and_count, g_test_pvalue, joint_vector, make_tables, saguaro_q
from tests.test_verify_api import greedy_reference


def _logits(p: torch.Tensor, temp: float) -> torch.Tensor:
    return temp * torch.log(p)  # -inf where p == 0


def run_logits(p, q, k, v, seed, *, temp=1.0, cap=None, q_mode="q", q_verify=None, wire=False) -> float:
    g = torch.Generator().manual_seed(seed)
    pt, d, qt = draw_chains(p, q, k, v, N, g)
    if q_verify is not None:
        from tests.test_verify import _dense, prefix_index

        qt = torch.stack([_dense(q_verify, v)[prefix_index(d[:, :j], v)] for j in range(k)], 1).float()
    q_in = None if q_mode == "none" else (quantize_proposal(qt) if wire else qt.half())
    max_accept = None if cap is None else torch.full((N,), cap)
    lens, out = verify_chain_logits(_logits(pt, temp), torch.full((N,), temp), d, q_in,
                                    torch.zeros(N, dtype=torch.bool), pt.argmax(-1), generator=g,
                                    max_accept=max_accept)
    return g_test_pvalue(extend_and_count(out, lens, p, v, g), joint_vector(p, k, v))


@pytest.mark.parametrize("v,k,kind,cap,q_mode,temp", [
    (3, 2, "dense", None, "q", 1.0), (4, 3, "sparse", None, "q", 0.7), (4, 2, "one_hot", None, "q", 1.0),
    (4, 2, "one_hot", None, "none", 1.3), (3, 3, "dense", 1, "q", 1.0), (3, 2, "equal", None, "q", 0.5),
])
def test_statistical(v, k, kind, cap, q_mode, temp):
    p, q = make_tables(v, k, kind, seed=11 * v + k)
    assert run_logits(p, q, k, v, seed=1234, temp=temp, cap=cap, q_mode=q_mode) > 1e-4


def test_negative_wrong_q():
    p, _ = make_tables(4, 2, "dense", seed=6)
    g = torch.Generator().manual_seed(6)
    z = {pre: 1.5 * torch.randn(4, generator=g, dtype=torch.float64) for pre in p if len(pre) < 2}
    q_true = {pre: saguaro_q(zz, 1, 0.3) for pre, zz in z.items()}
    q_raw = {pre: torch.softmax(zz, -1) for pre, zz in z.items()}
    assert run_logits(p, q_true, 2, 4, seed=2, wire=True) > 1e-4  # the same draws, correct q: passes
    assert run_logits(p, q_true, 2, 4, seed=2, q_verify=q_raw, wire=True) < 1e-9


def test_negative_residual_p(monkeypatch):
    p, q = make_tables(3, 2, "dense", seed=9)
    assert run_logits(p, q, 2, 3, seed=3) > 1e-4
    monkeypatch.setattr(verify, "_bonus_weights", lambda p_at, *a: p_at)  # bonus from p after a rejection
    assert run_logits(p, q, 2, 3, seed=3) < 1e-9


def test_negative_wrong_temperature():
    """Verifying against softmax(logits) when the sampler divides by T = 0.5 must be caught."""
    p, q = make_tables(3, 2, "dense", seed=10)
    g = torch.Generator().manual_seed(4)
    pt, d, qt = draw_chains(p, q, 2, 3, N, g)
    lens, out = verify_chain_logits(_logits(pt, 0.5), torch.ones(N), d, qt.half(), torch.zeros(N, dtype=torch.bool),
                                    pt.argmax(-1), generator=g)
    assert g_test_pvalue(extend_and_count(out, lens, p, 3, g), joint_vector(p, 2, 3)) < 1e-9


def test_accept_decisions_equal_verify_chain():
    """Both verifiers draw the B x K accept uniforms first from the generator: same coins, same n_acc
    (up to float rounding of p(d) at a threshold: at most a handful of rows in 40k)."""
    v, k = 50, 3
    g = torch.Generator().manual_seed(0)
    logits = 2.0 * torch.randn(N, k + 1, v, generator=g)
    q16 = quantize_proposal(torch.softmax(torch.randn(N, k, v, generator=g), -1))
    drafts = torch.multinomial(dequantize_proposal(q16).reshape(-1, v), 1, generator=g).view(N, k)
    greedy = torch.zeros(N, dtype=torch.bool)
    am = logits.argmax(-1)
    a, _ = verify_chain(torch.softmax(logits, -1), drafts, q16, greedy, target_argmax=am,
                        generator=torch.Generator().manual_seed(5))
    b, _ = verify_chain_logits(logits, torch.ones(N), drafts, q16, greedy, am, generator=torch.Generator().manual_seed(5))
    assert 0.2 < (a > 1).float().mean() < 0.9  # the coins really decide something
    assert (a != b).sum() <= 4


@pytest.mark.parametrize("use_cap", [False, True])
def test_greedy_rows_match_loop_reference(use_cap):
    g = torch.Generator().manual_seed(1)
    b, k, v = 300, 4, 6
    logits = 2 * torch.randn(b, k + 1, v, generator=g)
    am = logits.argmax(-1)
    drafts = torch.where(torch.rand(b, k, generator=g) < 0.25, torch.randint(0, v, (b, k), generator=g), am[:, :k])
    cap = torch.randint(0, k + 1, (b,), generator=g) if use_cap else torch.full((b,), k)
    temps = torch.zeros(b)  # a greedy row's temperature is never divided by
    lens, out = verify_chain_logits(logits, temps, drafts, None, torch.ones(b, dtype=torch.bool), am,
                                    generator=g, max_accept=cap)
    ref_lens, ref_out = greedy_reference(am, drafts, cap)
    assert torch.equal(lens, ref_lens) and torch.equal(out, ref_out)


def test_mixed_greedy_sampled_and_padded_rows():
    """Sampled rows keep the target law beside greedy rows and -1-padded (short) speculations."""
    v, k = 4, 2
    p, q = make_tables(v, k, "dense", seed=21)
    g = torch.Generator().manual_seed(0)
    pa, da, qa = draw_chains(p, q, k, v, N, g)
    pc, dc, qc = draw_chains(p, q, k, v, 300, g)
    dc[:100, 1] = -1  # depth-1 speculations (a cut build)
    greedy = torch.cat([torch.zeros(N, dtype=torch.bool), torch.ones(300, dtype=torch.bool)])
    pt = torch.cat([pa, pc])
    lens, out = verify_chain_logits(_logits(pt, 1.0), torch.ones(N + 300), torch.cat([da, dc]),
                                    torch.cat([qa, qc]).half(), greedy, pt.argmax(-1), generator=g)
    assert g_test_pvalue(extend_and_count(out[:N], lens[:N], p, v, g), joint_vector(p, k, v)) > 1e-4
    cap = torch.where(torch.arange(300) < 100, 1, k)
    ref_lens, ref_out = greedy_reference(pc.argmax(-1), dc.clamp_min(0), cap)
    assert torch.equal(lens[N:], ref_lens) and torch.equal(out[N:], ref_out)


@pytest.mark.parametrize("v", [700, 49152])
def test_blocked_inverse_cdf_law_and_edges(v, monkeypatch):
    """The two-level inverse CDF over many blocks (a padded last block for V = 700): frequencies follow
    probs (G-test on the heavy tokens, the rest pooled), zero tokens are never drawn, and u -> 1 lands on
    the last token with mass even when the row ends in zeros (a zero last block included)."""
    from scipy.stats import chi2

    g = torch.Generator().manual_seed(3)
    probs = 1e-3 * torch.rand(2, v, generator=g) ** 4  # a light tail ...
    heavy_ids = torch.arange(1, v - 300, (v - 300) // 40)
    heavy_ids = heavy_ids - (heavy_ids % 3) + 1  # ... and ~40 heavy tokens spread over the blocks
    probs[:, heavy_ids] = 0.5 + torch.rand(2, len(heavy_ids), generator=g)
    probs[:, ::3] = 0.0
    probs[0, v - 300:] = 0.0  # row 0: the last block(s) empty
    probs[1] *= 7.0  # row 1 unnormalised
    n, chunk = 4000, 500
    draws = torch.cat([verify.sample_inverse_cdf(probs.repeat(chunk, 1), g).view(chunk, 2) for _ in range(n // chunk)])
    for row in range(2):
        want = (probs[row] / probs[row].sum()).double()
        counts = torch.bincount(draws[:, row], minlength=v).double()
        assert counts[want == 0].sum() == 0
        heavy = want * n >= 10
        obs = torch.cat([counts[heavy], counts[~heavy].sum().view(1)])
        exp = torch.cat([want[heavy], want[~heavy].sum().view(1)]) * n
        keep = exp > 0
        obs, exp = obs[keep], exp[keep]
        gstat = 2 * float(torch.where(obs > 0, obs * (obs / exp).log(), torch.zeros_like(obs)).sum())
        assert chi2.sf(gstat, int(keep.sum()) - 1) > 1e-4
    real_rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **kw: torch.ones_like(real_rand(*a, **kw)))  # u = 1
    last = [int(torch.nonzero(probs[r]).max()) for r in range(2)]
    assert verify.sample_inverse_cdf(probs, g).tolist() == last


def test_wire_q_sums_equal_dense_sums_and_same_verdicts():
    """The link's per-row sums of the sparse wire q (reply_q_sums) equal the dense q16 row sums bit for
    bit, and verify_chain_logits gives the same result with them as without."""
    from sglang_ssd.sglang.link_state import reply_q16, reply_q_sums

    g = torch.Generator().manual_seed(2)
    bs, k, v, w = 6, 3, 300, 40
    ids = torch.sort(torch.randperm(v, generator=g)[:w]).values.numpy()
    q_rows = torch.tensor([0, 2, 3, 5])
    wire = quantize_proposal(torch.softmax(3 * torch.randn(4, k, w, generator=g), -1)).numpy()
    q16 = reply_q16(wire, ids, q_rows, bs, k, v, "cpu")
    sums = reply_q_sums(wire, q_rows, bs, k, "cpu")
    dense = q16.sum(dim=-1, dtype=torch.float64).to(torch.float32)
    assert torch.equal(sums[q_rows], dense[q_rows]) and torch.equal(sums[[1, 4]], torch.ones(2, k))
    q_valid = torch.zeros(bs, dtype=torch.bool)
    q_valid[q_rows] = True
    logits = torch.randn(bs, k + 1, v, generator=g)
    drafts = torch.from_numpy(ids[torch.randint(0, w, (bs, k), generator=g).numpy()])
    args = (logits, torch.full((bs,), 0.8), drafts, q16, torch.zeros(bs, dtype=torch.bool), logits.argmax(-1))
    a = verify_chain_logits(*args, generator=torch.Generator().manual_seed(1), q_valid=q_valid)
    b = verify_chain_logits(*args, generator=torch.Generator().manual_seed(1), q_valid=q_valid, q_sums=sums)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
