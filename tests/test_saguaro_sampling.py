"""Saguaro sampling sigma_{F,C} (sglang_ssd.saguaro.saguaro_sampling) and its exactness with verify_chain.

Exactness is checked two ways on tiny vocabularies with prefix-dependent target tables p(.|prefix)
and draft logits z(.|prefix):
* exact: enumerate every draft chain and accept/reject event with the verifier's own helpers,
  extend the round's output with target samples to K+1 tokens, compare with prod_j p(x_j|x_<j);
* statistical: draw chains from the wire q of sigma_{F,C}, run the real ``verify_chain`` on the
  float16 wire copy, G-test the K+1-token frequencies against the same joint.
Negative control: verifying the same draws against the unmodified softmax must be rejected.
The helpers here are reused by tests/test_ngram.py.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from typing import Callable

import pytest
import torch

import sglang_ssd.saguaro.verify as verify
from sglang_ssd.saguaro.proposal import dequantize_proposal, proposal_from_logits
from sglang_ssd.saguaro.saguaro_sampling import (saguaro_probs, saguaro_probs_rows, saguaro_proposal_from_logits,
                                                 saguaro_proposal_wire, saguaro_sample_rows, top_f_mask)

Prefix = tuple[int, ...]


# ----------------------------------------------------------------------------- shared helpers
def prefixes(v: int, max_len: int) -> list[Prefix]:
    """All prefixes of length 0..max_len, ordered by length then base-v value."""
    return [pre for n in range(max_len + 1) for pre in itertools.product(range(v), repeat=n)]


def target_table(v: int, k: int, seed: int) -> dict[Prefix, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for pre in prefixes(v, k):
        w = -torch.log(torch.rand(v, generator=g, dtype=torch.float64))  # Dirichlet(1)
        out[pre] = w / w.sum()
    return out


def exact_round(p, q_draft: Callable[[Prefix], torch.Tensor], q_verify: Callable[[Prefix], torch.Tensor],
                k: int, v: int) -> dict[Prefix, float]:
    """Exact law of one round's output when drafts come from q_draft and the verifier uses q_verify
    (both float64 distributions, functions of the prefix), via verify's per-step helpers."""
    out: dict[Prefix, float] = defaultdict(float)
    for d in itertools.product(range(v), repeat=k):
        reach = math.prod(float(q_draft(d[:j])[d[j]]) for j in range(k))
        if reach == 0.0:
            continue
        for n in range(k + 1):
            pre = d[:n]
            if n == k:  # everything accepted: bonus from p
                for x in range(v):
                    out[pre + (x,)] += reach * float(p[pre][x])
                break
            qv = q_verify(pre)
            a = float(verify.accept_probability(p[pre][d[n]], qv[d[n]]))
            resid = verify.residual_distribution(p[pre], qv)
            for x in range(v):
                out[pre + (x,)] += reach * (1.0 - a) * float(resid[x])
            reach *= a
    return out


def extend(dist: dict[Prefix, float], p, length: int, v: int) -> dict[Prefix, float]:
    """Continue every sequence with target samples up to `length` tokens."""
    out: dict[Prefix, float] = defaultdict(float)
    todo = list(dist.items())
    while todo:
        seq, pr = todo.pop()
        if len(seq) == length:
            out[seq] += pr
        else:
            todo.extend((seq + (x,), pr * float(p[seq][x])) for x in range(v))
    return out


def max_error(round_dist: dict[Prefix, float], p, k: int, v: int) -> float:
    got, want = extend(round_dist, p, k + 1, v), extend({(): 1.0}, p, k + 1, v)
    return max(abs(got.get(s, 0.0) - want.get(s, 0.0)) for s in set(got) | set(want))


def code_of(tokens: torch.Tensor, v: int) -> torch.Tensor:
    """Row index in ``prefixes(v, .)`` order of each prefix tokens [N, L]."""
    n = tokens.shape[1]
    idx = torch.full((tokens.shape[0],), (v**n - 1) // (v - 1), dtype=torch.long)
    for j in range(n):
        idx += tokens[:, j] * v ** (n - 1 - j)
    return idx


def sample_inv_cdf(probs: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    c = probs.double().cumsum(-1)
    u = torch.rand(probs.shape[0], 1, generator=g, dtype=torch.float64) * c[:, -1:]
    return (c <= u).sum(-1).clamp(max=probs.shape[-1] - 1)


def g_test_outputs(lens: torch.Tensor, out: torch.Tensor, p, k: int, v: int, g: torch.Generator) -> float:
    """Extend verified rounds with target samples to K+1 tokens; G-test p-value vs the joint.

    chi2 survival function as the regularised upper incomplete gamma (no scipy import cost)."""
    pd = torch.stack([p[pre] for pre in prefixes(v, k)])
    seq = out.clone()
    for j in range(k + 1):
        seq[:, j] = torch.where(j >= lens.long(), sample_inv_cdf(pd[code_of(seq[:, :j], v)], g), seq[:, j])
    counts = torch.bincount((seq * v ** torch.arange(k, -1, -1)).sum(-1), minlength=v ** (k + 1)).double()
    joint = extend({(): 1.0}, p, k + 1, v)
    exp = torch.tensor([joint[s] for s in itertools.product(range(v), repeat=k + 1)]) * counts.sum()
    big = exp >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    ex = torch.cat([exp[big], exp[~big].sum().view(1)])
    obs, ex = obs[ex > 0], ex[ex > 0]
    stat = 2.0 * float(torch.where(obs > 0, obs * torch.log(obs / ex), 0.0).sum())
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


# ----------------------------------------------------------------------------- sigma_{F,C}
def test_identity_cases_are_bit_identical():
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(5, 11, generator=g), -1)
    for f, c in [(3, 1.0), (0, 0.2), (11, 0.5), (20, 0.5)]:
        assert saguaro_probs(probs, f, c) is probs
    logits = torch.randn(5, 11, generator=g)
    temps = torch.tensor([0.7, 1.0, 1.3, 0.5, 2.0])
    assert torch.equal(saguaro_proposal_from_logits(logits, temps, 3, 1.0), proposal_from_logits(logits, temps))
    for bad in [(1, 0.0), (1, 1.5), (-1, 0.5), (1, math.nan)]:
        with pytest.raises(ValueError):
            saguaro_probs(probs, *bad)


def test_down_weighting_and_ties():
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.25, 0.25, 0.25, 0.25], [0.0, 1.0, 0.0, 0.0]])
    out = saguaro_probs(probs, 2, 0.5)
    w = torch.tensor([0.1, 0.2, 0.2, 0.15])  # tokens 1, 3 are the top-2
    torch.testing.assert_close(out[0], w / w.sum())
    torch.testing.assert_close(out[1], torch.tensor([0.125, 0.125, 0.25, 0.25]) / 0.75)  # ties -> ids 0, 1
    assert torch.equal(out[2], probs[2])  # one-hot stays exactly one-hot
    assert top_f_mask(torch.tensor([0.3, 0.3, 0.3, 0.1]), 2).tolist() == [True, True, False, False]


def _sorted_top_f(probs: torch.Tensor, fs: list[int]) -> torch.Tensor:
    """Reference rule, literally: a stable descending sort, first F_i ids of each row."""
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices
    ref = torch.zeros_like(probs, dtype=torch.bool)
    for i, f in enumerate(fs):
        ref[i, order[i, :f]] = True
    return ref


@pytest.mark.parametrize("seed", range(6))
def test_top_f_equals_stable_sort_rule(seed):
    """The O(V) top-F selection (topk + tie fill) picks exactly the stable-sort set, ties included: rows
    with few distinct values (many ties, zeros as in a reduced-vocabulary draft head) and F past the
    number of non-zero entries."""
    g = torch.Generator().manual_seed(seed)
    n, v = 40, 64
    probs = torch.randint(0, 4, (n, v), generator=g).float()  # values 0..3: ties everywhere
    probs[: n // 2] *= torch.rand(n // 2, v, generator=g) < 0.2  # mostly zero rows
    probs[:, 0] += 1e-3  # no all-zero row
    probs = probs / probs.sum(-1, keepdim=True)
    fs = torch.randint(0, v + 1, (n,), generator=g).tolist()
    ref = _sorted_top_f(probs, fs)
    from sglang_ssd.saguaro.saguaro_sampling import _top_f_rows
    assert torch.equal(_top_f_rows(probs, torch.tensor(fs)), ref)
    c = torch.rand(n, generator=g) * 0.9 + 0.05
    out = saguaro_probs_rows(probs, torch.tensor(fs), c)
    for i, f in enumerate(fs):  # and sigma built on it matches the single-row definition
        torch.testing.assert_close(out[i], saguaro_probs(probs[i], f, float(c[i])) if 0 < f < v else probs[i])
    cont = torch.softmax(3 * torch.randn(8, 1000, generator=g), -1)  # continuous rows: no ties
    assert torch.equal(top_f_mask(cont, 7), _sorted_top_f(cont, [7] * 8))


def test_wire_contract_and_sampling():
    g = torch.Generator().manual_seed(1)
    logits = 3 * torch.randn(6, 32, generator=g)
    temps = torch.tensor([0.0, 0.7, 1.0, 0.0, 1.5, 0.3])
    q, q16 = saguaro_proposal_wire(logits[temps > 0], temps[temps > 0], 3, 0.4)
    assert q16.dtype == torch.float16 and torch.equal(dequantize_proposal(q16), q)  # verifier sees this q
    tokens, q16_all = saguaro_sample_rows(logits, temps, 3, 0.4, torch.Generator().manual_seed(2))
    greedy = temps <= 0
    assert torch.equal(tokens[greedy], logits[greedy].argmax(-1)) and (q16_all[greedy] == 0).all()
    assert torch.equal(q16_all[~greedy], q16)
    assert saguaro_sample_rows(logits, torch.zeros(6), 3, 0.4)[1] is None


def test_residual_mass_on_top_f_grows_as_c_falls():
    """The point of the technique: P(bonus in top-F(q) | rejection) increases as C decreases."""
    g = torch.Generator().manual_seed(3)
    v, f = 40, 3
    z = 2 * torch.randn(200, v, generator=g, dtype=torch.float64)
    p = torch.softmax(z, -1)
    q = torch.softmax(z + torch.randn(200, v, generator=g, dtype=torch.float64), -1)  # a decent draft
    top = top_f_mask(q, f)
    masses, accept = [], []
    for c in (1.0, 0.8, 0.5, 0.3, 0.1, 0.01):
        qc = saguaro_probs(q, f, c)
        masses.append((verify.residual_distribution(p, qc) * top).sum(-1))
        accept.append(torch.minimum(p, qc).sum(-1).mean())
    for lo, hi in zip(masses, masses[1:]):
        assert (hi >= lo - 1e-12).all()  # per row, monotone
    assert masses[-1].mean() > masses[0].mean() + 0.3
    assert accept[-1] < accept[0]  # the price: lower acceptance


# ----------------------------------------------------------------------------- exactness
def draft_logits(v: int, k: int, seed: int) -> dict[Prefix, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {pre: 2.0 * torch.randn(v, generator=g) for pre in prefixes(v, k - 1)}


def wire_q(z, temp: float, f: int, c: float) -> Callable[[Prefix], torch.Tensor]:
    """The float32 q the draft samples from, as float64 renormalised (exact arithmetic reference)."""
    def q(pre: Prefix) -> torch.Tensor:
        x = saguaro_proposal_from_logits(z[pre], temp, f, c).double()
        return x / x.sum()
    return q


@pytest.mark.parametrize("v,k,f,c,temp", [(4, 1, 1, 0.3, 1.0), (5, 2, 2, 0.5, 0.7), (6, 2, 1, 0.1, 1.0),
                                          (4, 2, 3, 0.05, 1.3), (4, 2, 2, 1.0, 1.0)])
def test_exact_enumeration(v, k, f, c, temp):
    p, z = target_table(v, k, seed=v * 10 + k), draft_logits(v, k, seed=v + k)
    q = wire_q(z, temp, f, c)
    assert max_error(exact_round(p, q, q, k, v), p, k, v) < 1e-12
    if c < 1:  # negative control: verifier told the raw softmax instead of sigma_{F,C}
        raw = wire_q(z, temp, f, 1.0)
        assert max_error(exact_round(p, q, raw, k, v), p, k, v) > 1e-3


def draw_and_verify(p, z, v, k, temp, f, c, n, g, c_verify=None):
    """n chains drafted from the wire q of sigma_{F,C}; verify_chain on the float16 wire copy."""
    pd = torch.stack([p[pre] for pre in prefixes(v, k)]).float()
    zd = torch.stack([z[pre] for pre in prefixes(v, k - 1)])
    q_s, q16_s = saguaro_proposal_wire(zd, temp, f, c)
    q16_v = q16_s if c_verify is None else saguaro_proposal_wire(zd, temp, f, c_verify)[1]
    d = torch.zeros(n, k, dtype=torch.long)
    for j in range(k):
        d[:, j] = sample_inv_cdf(q_s[code_of(d[:, :j], v)], g)
    pt = torch.stack([pd[code_of(d[:, :j], v)] for j in range(k + 1)], 1)
    qt = torch.stack([q16_v[code_of(d[:, :j], v)] for j in range(k)], 1)
    return verify.verify_chain(pt, d, qt, torch.zeros(n, dtype=torch.bool), generator=g)


@pytest.mark.parametrize("v,k,f,c", [(4, 2, 1, 0.3), (5, 1, 2, 0.2)])
def test_statistical_with_verify_chain(v, k, f, c):
    p, z = target_table(v, k, seed=31 + v), draft_logits(v, k, seed=17 + k)
    g = torch.Generator().manual_seed(5)
    lens, out = draw_and_verify(p, z, v, k, 1.0, f, c, 40_000, g)
    assert g_test_outputs(lens, out, p, k, v, g) > 1e-4
    lens, out = draw_and_verify(p, z, v, k, 1.0, f, c, 40_000, g, c_verify=1.0)  # unmodified q: biased
    assert g_test_outputs(lens, out, p, k, v, g) < 1e-9
