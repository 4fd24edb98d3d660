"""N-gram fast backup (sglang_ssd.saguaro.ngram) and exact verification with its true q rows."""

from __future__ import annotations

import random
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sglang_ssd.saguaro.verify as verify
from sglang_ssd.saguaro.ngram import NgramIndex, NgramSpeculator, find_match, proposal_rows
from tests.test_saguaro_sampling import code_of, exact_round, g_test_outputs, max_error, prefixes, target_table


def test_longest_most_recent_match():
    toks = [5, 1, 2, 3, 9, 1, 2, 3, 7, 8, 2, 3]
    assert find_match(toks, 4) == (2, 8)  # "2 3" ends at 8 (most recent) -> copy 7, 8, 2, 3
    assert NgramSpeculator(4).propose(toks, 3, 100) == ([7, 8, 2], [False] * 3)
    toks = [5, 1, 2, 3, 9, 2, 3, 6, 1, 2, 3]
    assert find_match(toks, 4) == (3, 4)  # "1 2 3" (ends at 4) beats the more recent, shorter "2 3"
    assert NgramSpeculator(4).propose(toks, 2, 100)[0] == [9, 2]
    assert find_match(toks, 2) == (2, 7)  # capped at n = 2: the most recent "2 3" wins
    assert find_match(toks, 4, min_n=4) == (0, -1)
    assert find_match([1], 4) == (0, -1) and find_match([], 4) == (0, -1)


def test_self_extension_and_padding():
    toks = [3, 0, 0]
    assert NgramSpeculator(2).propose(toks, 4, 10) == ([0, 0, 0, 0], [False] * 4)  # periodic copy
    assert NgramSpeculator(3).propose([1, 2, 1, 2], 5, 10)[0] == [1, 2, 1, 2, 1]
    g = torch.Generator().manual_seed(0)
    got, rnd = NgramSpeculator(2, self_extend=False).propose(toks, 4, 10, g)
    assert got[0] == 0 and rnd == [False, True, True, True]  # short match: 1 copy, 3 random
    got, rnd = NgramSpeculator(2).propose([1, 2, 3], 3, 10, g)  # no match: all random
    assert rnd == [True] * 3 and all(0 <= t < 10 for t in got)


def test_random_padding_is_seeded():
    spec = NgramSpeculator(3)
    a = spec.propose([1, 2, 3, 4], 6, 50, torch.Generator().manual_seed(7))
    b = spec.propose([1, 2, 3, 4], 6, 50, torch.Generator().manual_seed(7))
    c = spec.propose([1, 2, 3, 4], 6, 50, torch.Generator().manual_seed(8))
    assert a == b and a[0] != c[0]


@settings(max_examples=150, deadline=None)
@given(toks=st.lists(st.integers(0, 3), max_size=40), max_n=st.integers(1, 4), min_n=st.integers(1, 4),
       k=st.integers(1, 6), self_extend=st.booleans())
def test_index_matches_scan(toks, max_n, min_n, k, self_extend):
    min_n = min(min_n, max_n)
    idx = NgramIndex(max_n, min_n, self_extend)
    spec = NgramSpeculator(max_n, min_n, self_extend)
    for i, t in enumerate(toks):  # incremental: every intermediate context agrees
        idx.append(t)
        if i % 7 == 0 or i == len(toks) - 1:
            assert idx.match() == find_match(toks[: i + 1], max_n, min_n)
            g1, g2 = torch.Generator().manual_seed(i), torch.Generator().manual_seed(i)
            assert idx.propose(k, 4, g1) == spec.propose(toks[: i + 1], k, 4, g2)


def _propose_after_scan(toks, extra, max_n, min_n, k, self_extend, g):
    """Reference for NgramIndex.propose_after: scan context + extra for its longest suffix n-gram whose
    successor is a context token (most recent first), copy from there over context + extra."""
    ext, n_ctx = list(toks) + list(extra), len(toks)
    for n in range(min(max_n, len(ext) - 1), min_n - 1, -1):
        for e in range(n_ctx - 1, n - 1, -1):
            if ext[e - n:e] == ext[len(ext) - n:]:
                out = []
                for i in range(k):
                    s = e + i
                    if s < len(ext):
                        out.append(ext[s])
                    elif self_extend:
                        out.append(out[s - len(ext)])
                    else:
                        break
                return out + torch.randint(0, 4, (k - len(out),), generator=g).tolist(), [False] * len(out) + [True] * (k - len(out))
    return torch.randint(0, 4, (k,), generator=g).tolist(), [True] * k


@settings(max_examples=150, deadline=None)
@given(toks=st.lists(st.integers(0, 3), max_size=30), extra=st.lists(st.integers(0, 3), max_size=3),
       max_n=st.integers(1, 4), min_n=st.integers(1, 4), k=st.integers(1, 4), self_extend=st.booleans())
def test_propose_after_matches_scan(toks, extra, max_n, min_n, k, self_extend):
    """The hybrid backup's tail: copies continue after tokens the draft model proposed, index untouched."""
    min_n = min(min_n, max_n)
    idx = NgramIndex(max_n, min_n, self_extend, tokens=toks)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert idx.propose_after(extra, k, 4, g1) == _propose_after_scan(toks, extra, max_n, min_n, k, self_extend, g2)
    assert len(idx) == len(toks)
    if not extra:
        g1, g2 = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
        assert idx.propose_after([], k, 4, g1) == idx.propose(k, 4, g2)


def test_fast_on_long_context():
    rng = random.Random(0)
    toks = [rng.randrange(32000) for _ in range(4000)]  # no repeats: full scan, the worst case
    t0 = time.perf_counter()
    NgramSpeculator(4).propose(toks, 5, 32000)
    scan = time.perf_counter() - t0
    idx = NgramIndex(4, tokens=toks)
    t0 = time.perf_counter()
    for _ in range(100):
        idx.propose(5, 32000)
    assert scan < 0.5 and (time.perf_counter() - t0) / 100 < 0.005


def test_proposal_rows():
    q = proposal_rows([2, 0, 3], [False, True, False], 4)
    assert q.tolist() == [[0, 0, 1, 0], [0.25] * 4, [0, 0, 0, 1]]


# ----------------------------------------------------------------------------- exactness
V, K = 4, 2
CONTEXTS = {"copy_then_random": [3, 0, 0], "all_random": [1, 2, 3], "all_copy": [2, 1, 3, 2, 1]}


def ngram_q(context, k, v):
    """(q_draft(prefix), q_verify(prefix)) of the n-gram proposal (self_extend=False): positions that
    copy are one-hot on the copied token, random ones uniform -- independent of the prefix drafted."""
    copied, rnd = NgramSpeculator(2, self_extend=False).propose(context, k, v, torch.Generator().manual_seed(0))
    rows = proposal_rows(copied, rnd, v, dtype=torch.float64)
    return lambda pre: rows[len(pre)], rnd


@pytest.mark.parametrize("name", list(CONTEXTS))
def test_exact_enumeration(name):
    p = target_table(V, K, seed=len(name))
    q, rnd = ngram_q(CONTEXTS[name], K, V)
    assert max_error(exact_round(p, q, q, K, V), p, K, V) < 1e-12
    if any(not r for r in rnd):  # negative control: call the copies uniform
        wrong = lambda pre: torch.full((V,), 1.0 / V, dtype=torch.float64)  # noqa: E731
        assert max_error(exact_round(p, q, wrong, K, V), p, K, V) > 1e-3


def test_statistical_with_verify_chain():
    """Real NgramSpeculator draws (fresh random pads per row) through verify_chain with its q rows."""
    n, context = 20_000, CONTEXTS["copy_then_random"]
    p = target_table(V, K, seed=3)
    g = torch.Generator().manual_seed(11)
    spec = NgramSpeculator(2, self_extend=False)
    props = [spec.propose(context, K, V, g) for _ in range(n)]
    drafts = torch.tensor([d for d, _ in props])
    assert (drafts[:, 0] == 0).all() and drafts[:, 1].unique().numel() == V
    rows = {key: proposal_rows(*key, V) for key in {(tuple(d), tuple(r)) for d, r in props}}  # V distinct
    q = torch.stack([rows[(tuple(d), tuple(r))] for d, r in props])
    pd = torch.stack([p[pre] for pre in prefixes(V, K)]).float()
    pt = torch.stack([pd[code_of(drafts[:, :j], V)] for j in range(K + 1)], 1)
    lens, out = verify.verify_chain(pt, drafts, q, torch.zeros(n, dtype=torch.bool), generator=g)
    assert g_test_outputs(lens, out, p, K, V, g) > 1e-4
    q_wrong = torch.full_like(q, 1.0 / V)  # copies mislabelled as uniform: biased
    lens, out = verify.verify_chain(pt, drafts, q_wrong, torch.zeros(n, dtype=torch.bool), generator=g)
    assert g_test_outputs(lens, out, p, K, V, g) < 1e-9
