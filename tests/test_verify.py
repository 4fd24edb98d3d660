"""Exactness of chain verification (sglang_ssd.saguaro.verify).

Two kinds of check on tiny vocabularies with prefix-dependent tables p(.|prefix), q(.|prefix):

* exact: enumerate every draft sequence and accept/reject event, using the verifier's own per-step
  helpers (``accept_probability``, ``residual_distribution``), extend the round's output with target
  samples to K+1 tokens and compare with the target joint prod_j p(x_j | x_<j) to 1e-12;
* statistical: draw chains, run the real ``verify_chain`` on a large seeded batch, extend with target
  samples and G-test the K+1-token frequencies against the same joint.  Negative controls (greedy
  acceptance of sampled drafts, verifying with a q other than the one drafted from, residual p
  instead of max(0, p - q)) must be rejected by the same test.

Greedy rows and the API's edge cases are tests/test_verify_api.py.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sglang_ssd.saguaro.verify as verify
from sglang_ssd.saguaro.verify import verify_chain

Table = dict[tuple[int, ...], torch.Tensor]


# ----------------------------------------------------------------------------- tables
def _dist(v: int, g: torch.Generator, sparse: bool) -> torch.Tensor:
    w = -torch.log(torch.rand(v, generator=g, dtype=torch.float64))  # Dirichlet(1)
    if sparse:  # zero out a random subset, keeping at least one token
        keep = torch.rand(v, generator=g) < 0.6
        keep[torch.randint(0, v, (1,), generator=g)] = True
        w = w * keep
    return w / w.sum()


def make_tables(v: int, k: int, kind: str, seed: int) -> tuple[Table, Table]:
    """p over prefixes of length 0..K, q over 0..K-1.  kind: dense | sparse | one_hot | equal."""
    g = torch.Generator().manual_seed(seed)
    prefixes = [pre for n in range(k + 1) for pre in itertools.product(range(v), repeat=n)]
    p = {pre: _dist(v, g, kind == "sparse") for pre in prefixes}
    q: Table = {}
    for pre in (x for x in prefixes if len(x) < k):
        if kind == "one_hot":
            q[pre] = torch.nn.functional.one_hot(torch.randint(0, v, (1,), generator=g)[0], v).double()
        elif kind == "equal":
            q[pre] = p[pre].clone()
        else:
            q[pre] = _dist(v, g, kind == "sparse")
    return p, q


def saguaro_q(z: torch.Tensor, f: int, c: float) -> torch.Tensor:
    """sigma_{F,C}: softmax with the top-F tokens down-weighted by C (notes 2.6)."""
    w = torch.softmax(z, -1)
    w[torch.topk(w, f).indices] *= c
    return w / w.sum()


# ----------------------------------------------------------------------------- exact enumeration
def round_distribution(p: Table, q: Table, k: int, v: int, cap: int | None = None,
                       rule: str = "exact", q_verify: Table | None = None) -> dict[tuple, float]:
    """Exact law of one round's output (accepted drafts + bonus).

    rule: "exact" (the verifier's), "residual_p" (bonus after rejection from p), "cap_residual"
    (forced stop at the cap treated as a rejection).  q_verify: the q the verifier is told about.
    """
    cap = k if cap is None else min(cap, k)
    qv = q if q_verify is None else q_verify
    out: dict[tuple, float] = defaultdict(float)
    for d in itertools.product(range(v), repeat=k):
        w = math.prod(float(q[d[:j]][d[j]]) for j in range(k))
        if w == 0.0:
            continue
        reach = w  # P(draft = d and d_1..d_n accepted)
        for n in range(cap + 1):
            pre, p_n = d[:n], p[d[:n]]
            if n == cap:
                forced = rule == "cap_residual" and n < k
                bonus = verify.residual_distribution(p_n, qv[pre]) if forced else p_n
                for x in range(v):
                    out[pre + (x,)] += reach * float(bonus[x])
                break
            a = float(verify.accept_probability(p_n[d[n]], qv[pre][d[n]]))
            bonus = p_n if rule == "residual_p" else verify.residual_distribution(p_n, qv[pre])
            for x in range(v):
                out[pre + (x,)] += reach * (1.0 - a) * float(bonus[x])
            reach *= a
    return out


def extend(dist: dict[tuple, float], p: Table, length: int, v: int) -> dict[tuple, float]:
    """Continue every sequence with target samples up to `length` tokens."""
    out: dict[tuple, float] = defaultdict(float)
    todo = list(dist.items())
    while todo:
        seq, pr = todo.pop()
        if len(seq) == length:
            out[seq] += pr
            continue
        todo.extend((seq + (x,), pr * float(p[seq][x])) for x in range(v) if p[seq][x] > 0)
    return out


def max_abs_diff(a: dict, b: dict) -> float:
    return max(abs(a.get(s, 0.0) - b.get(s, 0.0)) for s in set(a) | set(b))


def check_exact(p: Table, q: Table, k: int, v: int, **kw) -> float:
    got = extend(round_distribution(p, q, k, v, **kw), p, k + 1, v)
    return max_abs_diff(got, extend({(): 1.0}, p, k + 1, v))


CASES = [(3, 1, "dense"), (4, 2, "dense"), (5, 3, "dense"), (3, 3, "one_hot"), (5, 2, "one_hot"),
         (4, 3, "sparse"), (5, 2, "sparse"), (3, 2, "equal")]


@pytest.mark.parametrize("cap", [None, 0, 1])
@pytest.mark.parametrize("v,k,kind", CASES)
def test_exact_enumeration(v, k, kind, cap):
    p, q = make_tables(v, k, kind, seed=v * 100 + k * 10 + len(kind))
    assert check_exact(p, q, k, v, cap=cap) < 1e-12


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), v=st.integers(2, 4), k=st.integers(1, 3),
       kind=st.sampled_from(["dense", "sparse", "one_hot", "equal"]), cap=st.integers(0, 3))
def test_exact_enumeration_property(seed, v, k, kind, cap):
    p, q = make_tables(v, k, kind, seed)
    assert check_exact(p, q, k, v, cap=cap) < 1e-12


@pytest.mark.parametrize("rule,cap", [("residual_p", None), ("cap_residual", 1)])
def test_exact_enumeration_detects_wrong_rules(rule, cap):
    p, q = make_tables(4, 2, "dense", seed=7)
    assert check_exact(p, q, 2, 4, cap=cap, rule=rule) > 1e-3


def test_exact_enumeration_detects_wrong_q():
    p, _ = make_tables(4, 2, "dense", seed=8)
    g = torch.Generator().manual_seed(8)
    z = {pre: 1.5 * torch.randn(4, generator=g, dtype=torch.float64) for pre in p if len(pre) < 2}
    q_true = {pre: saguaro_q(zz, 1, 0.3) for pre, zz in z.items()}
    q_raw = {pre: torch.softmax(zz, -1) for pre, zz in z.items()}
    assert check_exact(p, q_true, 2, 4) < 1e-12
    assert check_exact(p, q_true, 2, 4, q_verify=q_raw) > 1e-3


def test_residual_helpers():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    tok = torch.tensor([1])
    one_hot = torch.nn.functional.one_hot(tok, 4).float()
    torch.testing.assert_close(verify.residual_one_hot(p, tok), verify.residual_distribution(p, one_hot))
    torch.testing.assert_close(verify.residual_one_hot(p, tok), torch.tensor([[5 / 7, 0.0, 2 / 7, 0.0]]))
    torch.testing.assert_close(verify.residual_distribution(p, p), p)  # all-zero residual -> p
    a = verify.accept_probability(torch.tensor([0.2, 0.5, 0.0, 0.3]), torch.tensor([0.4, 0.25, 0.1, 0.0]))
    torch.testing.assert_close(a, torch.tensor([0.5, 1.0, 0.0, 1.0]))


# ----------------------------------------------------------------------------- simulation
def _dense(tab: Table, v: int) -> torch.Tensor:
    """Stack a table in prefix_index order."""
    return torch.stack([tab[pre] for n in range(max(map(len, tab)) + 1)
                        for pre in itertools.product(range(v), repeat=n)])


def prefix_index(tokens: torch.Tensor, v: int) -> torch.Tensor:
    """Row of `_dense` for each prefix tokens[N, L] (enumeration order: by length, then base v)."""
    n = tokens.shape[1]
    idx = torch.full((tokens.shape[0],), (v**n - 1) // (v - 1), dtype=torch.long)
    for j in range(n):
        idx += tokens[:, j] * v ** (n - 1 - j)
    return idx


def sample_rows(probs: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """One inverse-CDF draw per row (faster than torch.multinomial for many tiny rows)."""
    c = probs.cumsum(-1)
    u = torch.rand(probs.shape[0], 1, generator=g, dtype=probs.dtype) * c[:, -1:]
    return (c <= u).sum(-1).clamp(max=probs.shape[-1] - 1)  # P(c_{i-1} <= u < c_i) = p_i


def draw_chains(p: Table, q: Table, k: int, v: int, n: int, g: torch.Generator):
    """n chains drafted from q -> (p [n, K+1, V], drafts [n, K], q [n, K, V]), float32."""
    pd, qd = _dense(p, v), _dense(q, v)
    d = torch.zeros(n, k, dtype=torch.long)
    for j in range(k):
        d[:, j] = sample_rows(qd[prefix_index(d[:, :j], v)], g)
    pt = torch.stack([pd[prefix_index(d[:, :j], v)] for j in range(k + 1)], 1)
    qt = torch.stack([qd[prefix_index(d[:, :j], v)] for j in range(k)], 1)
    return pt.float(), d, qt.float()


def extend_and_count(out: torch.Tensor, lens: torch.Tensor, p: Table, v: int, g: torch.Generator):
    """Continue each output with target samples to K+1 tokens; counts over the V^(K+1) sequences."""
    pd = _dense(p, v)
    seq = out.clone()
    for j in range(seq.shape[1]):
        draw = sample_rows(pd[prefix_index(seq[:, :j], v)], g)
        seq[:, j] = torch.where(j >= lens.long(), draw, seq[:, j])
    code = (seq * v ** torch.arange(seq.shape[1] - 1, -1, -1)).sum(-1)
    return torch.bincount(code, minlength=v ** seq.shape[1])


def joint_vector(p: Table, k: int, v: int) -> torch.Tensor:
    joint = extend({(): 1.0}, p, k + 1, v)
    return torch.tensor([joint.get(s, 0.0) for s in itertools.product(range(v), repeat=k + 1)],
                        dtype=torch.float64)


def g_test_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """G-test of counts against probs, bins with expectation < 5 merged; 0 if an impossible bin is hit."""
    counts = counts.double()
    exp = probs / probs.sum() * counts.sum()
    if counts[exp == 0].sum() > 0:
        return 0.0
    big = exp >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    ex = torch.cat([exp[big], exp[~big].sum().view(1)])
    keep = ex > 0
    obs, ex = obs[keep], ex[keep]
    stat = 2.0 * float(torch.where(obs > 0, obs * torch.log(obs / ex), 0.0).sum())
    df = obs.numel() - 1
    try:
        from scipy.stats import chi2
        return float(chi2.sf(stat, df))
    except ImportError:  # regularised upper incomplete gamma = chi2 survival function
        return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


N = 40_000


def run_and_test(p, q, k, v, seed, *, greedy=False, cap=None, q_mode="q", q_verify=None) -> float:
    g = torch.Generator().manual_seed(seed)
    pt, d, qt = draw_chains(p, q, k, v, N, g)
    if q_verify is not None:
        qt = torch.stack([_dense(q_verify, v)[prefix_index(d[:, :j], v)] for j in range(k)], 1).float()
    max_accept = None if cap is None else torch.full((N,), cap)
    lens, out = verify_chain(pt, d, None if q_mode == "none" else qt, torch.full((N,), greedy),
                             generator=g, max_accept=max_accept)
    return g_test_pvalue(extend_and_count(out, lens, p, v, g), joint_vector(p, k, v))


@pytest.mark.parametrize("v,k,kind,cap,q_mode", [
    (3, 2, "dense", None, "q"), (4, 3, "sparse", None, "q"), (4, 2, "one_hot", None, "q"),
    (4, 2, "one_hot", None, "none"), (3, 3, "dense", 1, "q"), (3, 2, "equal", None, "q"),
])
def test_statistical(v, k, kind, cap, q_mode):
    p, q = make_tables(v, k, kind, seed=11 * v + k)
    assert run_and_test(p, q, k, v, seed=1234, cap=cap, q_mode=q_mode) > 1e-4


def test_negative_greedy_acceptance_on_sampled_rows():
    p, q = make_tables(3, 2, "dense", seed=5)
    assert run_and_test(p, q, 2, 3, seed=1, greedy=True) < 1e-9


def test_negative_wrong_q():
    p, _ = make_tables(4, 2, "dense", seed=6)
    g = torch.Generator().manual_seed(6)
    z = {pre: 1.5 * torch.randn(4, generator=g, dtype=torch.float64) for pre in p if len(pre) < 2}
    q_true = {pre: saguaro_q(zz, 1, 0.3) for pre, zz in z.items()}
    q_raw = {pre: torch.softmax(zz, -1) for pre, zz in z.items()}
    assert run_and_test(p, q_true, 2, 4, seed=2) > 1e-4  # the same draws, correct q: passes
    assert run_and_test(p, q_true, 2, 4, seed=2, q_verify=q_raw) < 1e-9


def test_negative_residual_p(monkeypatch):
    p, q = make_tables(3, 2, "dense", seed=9)
    monkeypatch.setattr(verify, "residual_distribution", lambda p_, q_: p_)
    assert run_and_test(p, q, 2, 3, seed=3) < 1e-9
