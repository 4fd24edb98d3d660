"""Greedy prompt lookup (saguaro/lookup.py, draft/lookup.py): the n-gram copy replaces an unsure draft token
of a greedy row, in the just-in-time backup (sync mode's drafting) and in every depth of the cache build;
sampled rows never change; the rule's setting parses strictly."""

from __future__ import annotations

import random

import pytest
import torch

from sglang_ssd.draft.engine import DraftEngine
from sglang_ssd.draft.lookup import GreedyLookup
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
    n, p = torch.tensor([1, 2, 2, 5, 0]), torch.tensor([0.1, 0.5, 0.9, 0.79, 0.0])
    assert take_copy(n, p, 2, 0.8).tolist() == [False, True, False, True, False]
    assert take_copy(n, p, 2, 1.0).tolist() == [False, True, True, True, False]


def _state(rid, tokens, temp):
    st = RequestState(rid, list(tokens), kv=None, temperature=temp)
    return st


def test_apply_copies_only_unsure_greedy_rows():
    ctx = [5, 6, 7, 8, 5, 6]                       # suffix (5, 6) recurs: the copy is 7
    lk = GreedyLookup((2, 0.8), from_env=False)
    unsure, sure = torch.zeros(2, 10), torch.zeros(2, 10)
    sure[:, 3] = 20.0
    toks = torch.tensor([3, 3])
    states = [_state("g", ctx, 0.0), _state("s", ctx, 1.0)]
    assert lk.apply(states, [[], []], unsure, toks).tolist() == [7, 3]      # sampled row kept
    assert lk.apply(states, [[], []], sure, toks).tolist() == [3, 3]        # confident draft kept
    assert lk.apply(states, [[9], []], unsure, toks).tolist() == [3, 3]     # (6, 9) / (9,) never seen
    assert lk.apply(states, [[8, 5], []], unsure, toks).tolist() == [6, 3]  # context + extra: (8, 5) -> 6
    assert (lk.rows, lk.copies) == (4, 2)
    off = GreedyLookup(None, from_env=False)
    assert not off.on and off.apply(states, [[], []], unsure, toks) is toks


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
