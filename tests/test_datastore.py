"""Corpus lookup (saguaro/datastore.py, draft/lookup.py): the store keeps the most frequent continuation of each
n-gram of the answers when its share is high enough, answers with the longest stored suffix, loads what it
saved; an unsure greedy row of the draft takes it where the request's own lookup did not act, in the
just-in-time backup and in every depth of the cache build; sampled rows never read it."""

from __future__ import annotations

import random
from collections import Counter, defaultdict

import numpy as np
import pytest
import torch

from sglang_ssd.draft.engine import DraftEngine
from sglang_ssd.draft.lookup import Lookup
from sglang_ssd.draft.runner import ForwardItem
from sglang_ssd.draft.state import RequestState
from sglang_ssd.protocol import PROTOCOL_VERSION, Hello, Prefill, Speculate
from sglang_ssd.saguaro.datastore import Datastore, hash_ngrams, hash_tail, load_for
from sglang_ssd.saguaro.lookup import CORPUS_ENV, LOOKUP_ENV, parse_corpus
from tests.draft_helpers import FAN, K, V
from tests.draft_helpers import model_dir, runner  # noqa: F401  (fixtures)
from tests.tiny_models import greedy_reference


def brute_next(seqs, ctx, ns, min_share):
    """Longest n (of ns) whose suffix n-gram of ctx has a continuation with share >= min_share in the answers;
    the most frequent (smallest id on ties)."""
    for n in sorted(ns, reverse=True):
        if len(ctx) < n:
            continue
        counts: dict[tuple, Counter] = defaultdict(Counter)
        for toks, plen in seqs:
            for i in range(max(n, plen), len(toks)):
                counts[tuple(toks[i - n:i])][toks[i]] += 1
        c = counts.get(tuple(ctx[-n:]))
        if c:
            best = min(c, key=lambda t: (-c[t], t))
            if c[best] >= min_share * sum(c.values()):
                return n, best
    return None


def test_hash_tail_matches_hash_ngrams():
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 50000, 40)
    for n in (1, 3, 8):
        h = hash_ngrams(toks, n)
        assert all(int(h[i]) == hash_tail(toks[: i + n].tolist(), n) for i in range(len(h)))


@pytest.mark.parametrize("seed", range(4))
def test_store_answers_as_brute_force(seed, tmp_path):
    rng = random.Random(seed)
    seqs = []
    for _ in range(30):
        plen = rng.randint(0, 6)
        seqs.append(([rng.randint(0, 4) for _ in range(rng.randint(1, 25))], plen))
    ns, share = (2, 3), 0.6
    store = Datastore.build([(np.array(t), p) for t, p in seqs], ns=ns, min_share=share)
    store.save(tmp_path / "s.npz")
    loaded = Datastore.load(tmp_path / "s.npz")
    assert loaded.ns == (3, 2) and loaded.min_share == share and len(loaded) == len(store)
    found = 0
    for _ in range(300):
        ctx = [rng.randint(0, 4) for _ in range(rng.randint(1, 6))]
        want = brute_next(seqs, ctx, ns, share)
        assert store.next_token(ctx) == want and loaded.next_token(ctx) == want
        found += want is not None
    assert found > 50  # the check ran on real hits, not only on misses
    # the store reads only the tail: a longer context with the same tail gives the same answer
    assert store.next_token([9, 9, 9] + [1, 2, 3]) == store.next_token([1, 2, 3])


def test_load_for_a_draft_dir(tmp_path):
    assert load_for(None) is None and load_for(str(tmp_path)) is None
    Datastore.build([(np.array([1, 2, 3, 4]), 0)], ns=(2,)).save(tmp_path / "datastore.npz")
    assert load_for(str(tmp_path)).next_token([2, 3]) == (2, 4)


def test_parse_corpus():
    assert parse_corpus(None) == parse_corpus("on") == 0.7
    assert parse_corpus("off") is None and parse_corpus("0.5") == 0.5 and parse_corpus("1") == 1.0
    assert parse_corpus("0") is None
    for bad in ("x", "1.5", "-0.2"):
        with pytest.raises(ValueError, match=CORPUS_ENV):
            parse_corpus(bad)


STORE = Datastore.build([(np.array([3, 4, 5, 6, 7, 3, 4, 9]), 0)], ns=(2,), min_share=0.5)  # (3, 4) -> 5 or 9: 5


def _state(tokens, temp):
    return RequestState("r", list(tokens), kv=None, temperature=temp)


def test_apply_takes_the_corpus_only_where_the_draft_is_unsure():
    lk = Lookup(None, None, from_env=False, corpus=STORE, corpus_max_p=0.7)
    unsure, sure = torch.zeros(2, 10), torch.zeros(2, 10)
    sure[:, 2] = 20.0
    toks = torch.tensor([2, 2])
    states = [_state([1, 3, 4], 0.0), _state([1, 3, 4], 1.0)]
    assert lk.reads(states[:1]) and not lk.reads(states[1:])
    assert lk.apply(states, [[], []], unsure, toks).tolist() == [5, 2]      # sampled row never changes
    assert lk.apply(states, [[], []], sure, toks).tolist() == [2, 2]        # a confident draft stands
    assert lk.apply(states, [[5, 6], []], unsure, toks).tolist() == [7, 2]  # context + extra: (5, 6) -> 7
    assert lk.apply(states, [[9], []], unsure, toks).tolist() == [2, 2]     # (4, 9) not stored
    assert lk.corpus_copies == 2
    # the request's own copy comes first: context 5 6 7 8 5 6 has its own (5, 6) -> 7 while the corpus says 7 -> 3
    both = Lookup((2, 0.8), None, from_env=False, corpus=STORE, corpus_max_p=0.7)
    st = [_state([5, 6, 7, 8, 5, 6], 0.0)]
    assert both.apply(st, [[]], unsure[:1], toks[:1]).tolist() == [7]
    assert both.apply(st, [[7]], unsure[:1], toks[:1]).tolist() == [8]      # own (6, 7) -> 8 over corpus 3
    assert both.apply([_state([1, 3], 0.0)], [[4]], unsure[:1], toks[:1]).tolist() == [5]  # own none: corpus
    assert Lookup(None, None, from_env=False, corpus=None).reads(states[:1]) is False


def corpus_reference(runner, ctx, n, store) -> list[int]:
    """Sequential greedy decode of n tokens after ctx where the store's continuation replaces the argmax
    (corpus max_p = 1, the request's own lookup off)."""
    kv = runner.new_kv()
    logits = runner.forward([ForwardItem.extend(kv, ctx, 0)], cols=True)[0][0]
    out = []
    for i in range(n):
        hit = store.next_token(list(ctx) + out)
        out.append(hit[1] if hit else int(runner.to_tokens(logits.argmax())))
        if i + 1 < n:
            logits = runner.forward([ForwardItem.extend(kv, [out[-1]], len(ctx) + i)], cols=True)[0][0]
    return out


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_engine_speculations_follow_the_corpus(runner, monkeypatch, mode):
    monkeypatch.setenv(LOOKUP_ENV, "off")
    monkeypatch.setenv(CORPUS_ENV, "1.0")  # take the store's continuation wherever it has one
    prompt = [5, 6, 7, 8, 9, 10, 11]
    store = Datastore.build([(np.array([9, 10, 11, 8, 3, 12, 13, 2, 1]), 0)], ns=(2, 3))
    e = DraftEngine(runner, seed=1, corpus=store)
    e.hello(Hello(PROTOCOL_VERSION, "t", K, mode, FAN, V, [1], None, "neural"))
    e.prefill(Prefill(["g", "s"], [prompt, prompt], [0.0, 1.0], [1.0, 1.0]))
    reply = e.speculate(Speculate(0, ["g", "s"], [-1, -1], [8, 8], [0.0, 1.0]))
    ctx = prompt + [8]
    want = corpus_reference(runner, ctx, K, store)
    assert reply.tokens[0].tolist() == want
    assert want != greedy_reference(runner, ctx, K)  # the store changed the draft's own choice
    assert e.health()["lookup_corpus"] >= 1
    if mode == "async":
        e.build_cache()
        keys = e.cache.keys("g")
        assert keys
        for j, g in keys:  # every cached branch: the corpus decode after the outcome (j accepted, bonus g)
            assert e.cache.peek("g", j, g).tokens.tolist() == corpus_reference(runner, ctx + want[:j] + [g], K, store)
    monkeypatch.setenv(CORPUS_ENV, "off")
    e2 = DraftEngine(runner, seed=1, corpus=store)
    e2.hello(Hello(PROTOCOL_VERSION, "t", K, mode, FAN, V, [1], None, "neural"))
    e2.prefill(Prefill(["g"], [prompt], [0.0], [1.0]))
    assert e2.speculate(Speculate(0, ["g"], [-1], [8], [0.0])).tokens[0].tolist() == greedy_reference(runner, ctx, K)
    assert e2.health()["lookup_corpus"] == 0
