"""Greedy prompt lookup (saguaro/lookup.py, draft/lookup.py): the n-gram copy replaces an unsure draft token
of a greedy row, in the just-in-time backup (sync mode's drafting) and in every depth of the cache build;
sampled rows never change; the rule's setting parses strictly."""

from __future__ import annotations

import random

import pytest
import torch

from sglang_ssd.draft.engine import DraftEngine
from sglang_ssd.draft.lookup import Lookup
from sglang_ssd.draft.runner import ForwardItem
from sglang_ssd.draft.state import RequestState
from sglang_ssd.protocol import PROTOCOL_VERSION, Hello, Prefill, Speculate
from sglang_ssd.saguaro.lookup import LOOKUP_ENV, parse_lookup, take_copy
from sglang_ssd.saguaro.ngram import NgramIndex
from tests.draft_helpers import FAN, K, V
from tests.draft_helpers import model_dir, runner  # noqa: F401  (fixtures)
from tests.tiny_models import greedy_reference


def test_match_tail_is_propose_afters_first_copy():
    rng = random.Random(0)
    for _ in range(300):
        toks = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        extra = [rng.randrange(4) for _ in range(rng.randrange(0, 6))]
        idx = NgramIndex(4, 1, tokens=toks)
        n, tok = idx.match_tail(extra)
        prop, rnd = idx.propose_after(extra, 1, 10**6)
        if n == 0:
            assert tok == -1 and (rnd[0] or len(toks) + len(extra) < 2)
        else:
            assert not rnd[0] and prop[0] == tok and 1 <= n <= 4
            ext = toks + extra
            assert ext[len(ext) - n:] in [toks[e - n:e] for e in range(n, len(toks))]


def test_parse_and_rule():
    assert parse_lookup(None) == (2, 0.8) and parse_lookup("on") == (2, 0.8)
    assert parse_lookup("off") is None and parse_lookup("3,0.5") == (3, 0.5)
    for bad in ("2", "x,0.5", "0,0.5", "2,0", "2,1.5"):
        with pytest.raises(ValueError, match=LOOKUP_ENV):
            parse_lookup(bad)
    from sglang_ssd.saguaro.lookup import MIX_ENV, parse_mix
    assert parse_mix(None) is None and parse_mix("") is None and parse_mix("on") == (2, 0.5)
    assert parse_mix("1,0.25") == (1, 0.25)
    with pytest.raises(ValueError, match=MIX_ENV):
        parse_mix("1,2")
    n, p = torch.tensor([1, 2, 2, 5, 0]), torch.tensor([0.1, 0.5, 0.9, 0.79, 0.0])
    assert take_copy(n, p, 2, 0.8).tolist() == [False, True, False, True, False]
    assert take_copy(n, p, 2, 1.0).tolist() == [False, True, True, True, False]


def _state(rid, tokens, temp):
    st = RequestState(rid, list(tokens), kv=None, temperature=temp)
    return st


def test_apply_copies_only_unsure_greedy_rows():
    ctx = [5, 6, 7, 8, 5, 6]                       # suffix (5, 6) recurs: the copy is 7
    lk = Lookup((2, 0.8), from_env=False)
    unsure, sure = torch.zeros(2, 10), torch.zeros(2, 10)
    sure[:, 3] = 20.0
    toks = torch.tensor([3, 3])
    states = [_state("g", ctx, 0.0), _state("s", ctx, 1.0)]
    assert lk.apply(states, [[], []], unsure, toks).tolist() == [7, 3]      # sampled row kept
    assert lk.apply(states, [[], []], sure, toks).tolist() == [3, 3]        # confident draft kept
    assert lk.apply(states, [[9], []], unsure, toks).tolist() == [3, 3]     # (6, 9) / (9,) never seen
    assert lk.apply(states, [[8, 5], []], unsure, toks).tolist() == [6, 3]  # context + extra: (8, 5) -> 6
    assert (lk.rows, lk.copies) == (4, 2)
    off = Lookup(None, from_env=False)
    assert not off.on and off.apply(states, [[], []], unsure, toks) is toks
    # reads: the rows a caller must build contexts for (greedy under the rule, sampled under the mixture)
    assert lk.reads(states) and lk.reads(states[:1]) and not lk.reads(states[1:])
    mix_only = Lookup(None, (2, 0.5), from_env=False)
    assert mix_only.reads(states[1:]) and not mix_only.reads(states[:1]) and not off.reads(states)


def lookup_reference(runner, committed, extra, n, setting=(2, 0.8)) -> list[int]:
    """Sequential greedy decode of n tokens after committed + extra with the lookup rule applied per step
    (index over the committed tokens, the speculative tokens as the match's tail)."""
    idx = NgramIndex(4, 1, tokens=committed)
    ctx = list(committed) + list(extra)
    kv = runner.new_kv()
    logits = runner.forward([ForwardItem.extend(kv, ctx, 0)], cols=True)[0][0]
    out = []
    for i in range(n):
        tok = int(runner.to_tokens(logits.argmax()))
        m, copy = idx.match_tail(list(extra) + out)
        if m >= setting[0] and copy != tok and float(torch.softmax(logits, -1).max()) < setting[1]:
            tok = copy
        out.append(tok)
        if i + 1 < n:
            logits = runner.forward([ForwardItem.extend(kv, [tok], len(ctx) + i)], cols=True)[0][0]
    return out


PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]   # periodic: the copy continues 8 9 5 6 ...


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_engine_speculations_follow_the_lookup(runner, monkeypatch, mode):
    monkeypatch.setenv(LOOKUP_ENV, "2,1.0")  # copy whenever a 2-gram recurs: the tiny draft never continues it
    e = DraftEngine(runner, seed=1)
    e.hello(Hello(PROTOCOL_VERSION, "t", K, mode, FAN, V, [1], None, "neural"))
    e.prefill(Prefill(["g", "s"], [PROMPT, PROMPT], [0.0, 1.0], [1.0, 1.0]))
    reply = e.speculate(Speculate(0, ["g", "s"], [-1, -1], [8, 8], [0.0, 1.0]))
    ctx = PROMPT + [8]
    want = lookup_reference(runner, ctx, [], K, (2, 1.0))
    assert reply.tokens[0].tolist() == want
    assert want != greedy_reference(runner, ctx, K)  # the lookup changed the draft's own choice
    assert e.health()["lookup_copies"] >= 1 and e.health()["lookup_rows"] >= K
    if mode == "sync":
        return
    e.build_cache()
    keys = e.cache.keys("g")
    assert keys
    # the bonus guesses after "all K accepted" (F = 2 there) include the copy that follows that context
    _, copy = NgramIndex(4, 1, tokens=ctx).match_tail(want)
    assert (K, copy) in keys and e.health()["lookup_guesses"] >= 1
    for j, g in keys:  # every cached branch: the lookup's decode after the outcome (j accepted, bonus g)
        entry = e.cache.peek("g", j, g)
        assert entry.tokens.tolist() == lookup_reference(runner, ctx, want[:j] + [g], K, (2, 1.0))
    monkeypatch.setenv(LOOKUP_ENV, "off")
    e2 = DraftEngine(runner, seed=1)
    e2.hello(Hello(PROTOCOL_VERSION, "t", K, mode, FAN, V, [1], None, "neural"))
    e2.prefill(Prefill(["g"], [PROMPT], [0.0], [1.0]))
    assert e2.speculate(Speculate(0, ["g"], [-1], [8], [0.0])).tokens[0].tolist() == greedy_reference(runner, ctx, K)
    assert e2.health()["lookup_copies"] == 0


def test_sample_rows_draws_from_the_mixture_it_returns():
    from sglang_ssd.draft.sampling import sample_rows
    from sglang_ssd.saguaro.lookup import mix_copy
    from sglang_ssd.saguaro.proposal import dequantize_proposal, quantize_proposal

    z = torch.log(torch.tensor([0.6, 0.3, 0.1, 0.0 + 1e-9]))
    z = torch.stack([z, z, z])
    cols = torch.tensor([3, -1, 0])
    tok, q16 = sample_rows(z, [1.0, 1.0, 0.0], torch.Generator().manual_seed(0), mix=(cols, 0.5))
    want = quantize_proposal(mix_copy(torch.softmax(z[:2], -1), cols[:2], 0.5))
    assert torch.equal(q16[:2], want) and not q16[2].any() and tok[2] == 0  # greedy rows: argmax, no q
    assert torch.allclose(dequantize_proposal(q16[0]), torch.tensor([0.3, 0.15, 0.05, 0.5]), atol=1e-3)
    n = 6000
    zz = z[:1].repeat(n, 1)
    tok, q16 = sample_rows(zz, [1.0] * n, torch.Generator().manual_seed(1), mix=(torch.full((n,), 3), 0.5))
    freq = torch.bincount(tok, minlength=4).float() / n
    torch.testing.assert_close(freq, dequantize_proposal(q16[0]), atol=0.025, rtol=0)
    with pytest.raises(ValueError, match="support"):
        sample_rows(z, [1.0] * 3, mix=(cols, 0.5), support=torch.arange(4))


def test_sampled_rows_send_the_mixture_they_drew_from(runner, monkeypatch):
    """Sync mode, T = 1, w = 1: every proposal whose suffix recurs is the copy itself, q one-hot there; with
    the mixture off the same request gets the draft's own q (a row differs)."""
    from sglang_ssd.saguaro.lookup import MIX_ENV
    from sglang_ssd.saguaro.proposal import dequantize_proposal
    from tests.tiny_models import next_logits

    monkeypatch.setenv(MIX_ENV, "2,1.0")
    e = DraftEngine(runner, seed=3)
    e.hello(Hello(PROTOCOL_VERSION, "t", K, "sync", FAN, V, [1], None, "neural"))
    e.prefill(Prefill(["s"], [PROMPT], [1.0], [1.0]))
    reply = e.speculate(Speculate(0, ["s"], [-1], [8], [1.0]))
    ctx, got = PROMPT + [8], reply.tokens[0].tolist()
    idx = NgramIndex(4, 1, tokens=ctx)
    q = dequantize_proposal(torch.as_tensor(reply.q_for_row(0, V)))
    assert got == [9, 5, 6]  # the periodic continuation, copied at every depth
    for t in range(K):
        assert idx.match_tail(got[:t]) == (4, got[t]) and q[t, got[t]] == 1.0
    assert e.health()["lookup_mixed"] == K
    monkeypatch.setenv(MIX_ENV, "2,0.5")
    e = DraftEngine(runner, seed=3)
    e.hello(Hello(PROTOCOL_VERSION, "t", K, "sync", FAN, V, [1], None, "neural"))
    e.prefill(Prefill(["s"], [PROMPT], [1.0], [1.0]))
    reply = e.speculate(Speculate(0, ["s"], [-1], [8], [1.0]))
    got = reply.tokens[0].tolist()
    q = dequantize_proposal(torch.as_tensor(reply.q_for_row(0, V)))
    _, copy = idx.match_tail([])
    ref = 0.5 * torch.softmax(next_logits(runner, ctx), -1)
    ref[copy] += 0.5
    torch.testing.assert_close(q[0], ref, atol=1e-5, rtol=2e-3)
