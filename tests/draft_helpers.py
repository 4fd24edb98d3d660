"""Shared by the draft tests (test_draft_engine, test_draft_backups, test_draft_server): a tiny draft model,
its runner, the verifier's side of the conversation (`Target`), outcome picking and the sequential references
the cache and q are checked against."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from sglang_ssd.draft.engine import DraftEngine
from sglang_ssd.draft.runner import DraftRunner
from sglang_ssd.protocol import Prefill, Speculate, decode
from sglang_ssd.saguaro.proposal import dequantize_proposal
from sglang_ssd.saguaro.saguaro_sampling import saguaro_probs
from tests.tiny_models import greedy_reference, make_tiny_model, next_logits

torch.set_num_threads(1)

K = 3
FAN = [2, 1, 1, 2]
FAN_MISS = [3, 1, 1, 1]
V = 96
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = {"r0": [5, 9, 17, 33, 2], "r1": [40, 41], "r2": [7, 8, 9, 10, 11, 12, 13, 14, 15]}


@pytest.fixture(scope="module")
def model_dir():
    return make_tiny_model(vocab_size=V, seed=1)


@pytest.fixture(scope="module")
def runner(model_dir):
    return DraftRunner.from_dir(model_dir)


class Target:
    """The verifier's side of the conversation: tracks each request's context and last speculation."""

    def __init__(self, engine: DraftEngine, temps: dict[str, float], cs: dict[str, float] | None = None):
        self.e, self.temps = engine, temps
        self.ctx = {r: list(p) for r, p in PROMPTS.items()}
        self.spec: dict[str, list[int]] = {}
        self.round = 0
        engine.prefill(Prefill(list(PROMPTS), list(PROMPTS.values()), [temps[r] for r in PROMPTS],
                               [(cs or {}).get(r, 1.0) for r in PROMPTS]))

    def step(self, outcomes: dict[str, tuple[int, int]]):
        rids = list(outcomes)
        msg = Speculate(self.round, rids, [outcomes[r][0] for r in rids], [outcomes[r][1] for r in rids],
                        [self.temps[r] for r in rids])
        self.round += 1
        for r in rids:
            k, b = outcomes[r]
            self.ctx[r] += (self.spec[r][:k] if k >= 0 else []) + [b]
        reply = decode([bytes(f) for f in self.e.speculate(msg).encode()])  # through the wire format
        for i, r in enumerate(rids):
            self.spec[r] = reply.tokens[i].tolist()
            assert self.e.requests[r].tokens == self.ctx[r]
        if self.e.session.mode == "async":
            self.e.build_cache()
        return rids, reply


KINDS = ["hit", "miss", "hit", "reset", "hit", "odd"]


def pick_outcome(rng: random.Random, e: DraftEngine, rid: str, spec: list[int],
                 kind: str = "") -> tuple[tuple[int, int], bool]:
    """A cached outcome (-> hit), a fresh miss, k = -1, or the odd 'bonus == rejected draft' miss."""
    keys = e.cache.keys(rid)
    kind = kind or rng.choice(KINDS)
    if kind == "hit" and keys:
        return rng.choice(keys), True
    if kind == "reset":
        return (-1, rng.randrange(V)), False
    k = rng.randint(0, K)
    if kind == "odd" and k < K:
        return (k, spec[k]), False          # never a real outcome; must still be handled exactly
    b = rng.choice([t for t in range(V) if (k, t) not in keys and (k == K or t != spec[k])])
    return (k, b), False


def check_cache_greedy(runner, e: DraftEngine, t: Target, rid: str) -> None:
    """Every cached (rid, j, b) holds the sequential greedy decode from C + s[:j] + [b], and the
    guesses at j are the top-fan_out[j] draft tokens there, s_{j+1} excluded."""
    ctx, spec, keys = t.ctx[rid], t.spec[rid], e.cache.keys(rid)
    fan = FAN if e.requests[rid].last_hit else FAN_MISS
    for j in range(K + 1):
        z = next_logits(runner, ctx + spec[:j])
        if j < K:
            z[spec[j]] = -float("inf")
        want = set(torch.topk(z, fan[j]).indices.tolist())
        assert {b for jj, b in keys if jj == j} == want, (rid, j)
    for j, b in keys:
        entry = e.cache.peek(rid, j, b)
        assert entry.q16 is None
        assert entry.tokens.tolist() == greedy_reference(runner, ctx + spec[:j] + [b], K), (rid, j, b)


def check_q(runner, ctx: list[int], toks: list[int], q16, temp: float, fs=None, c: float = 1.0) -> None:
    """q row t == softmax(z_t / T) of a sequential recomputation (fp16 rounding), token drawn from it;
    with Saguaro sampling, sigma_{F_t, C} of it (F_t = fs[t])."""
    q = dequantize_proposal(torch.as_tensor(np.asarray(q16)))
    for i, tok in enumerate(toks):
        ref = torch.softmax(next_logits(runner, ctx + toks[:i]) / temp, -1)
        if fs is not None:
            ref = saguaro_probs(ref[None], fs[i], c)[0]
        torch.testing.assert_close(q[i], ref, atol=1e-5, rtol=2e-3)  # fp16: 2^-11 relative
        assert q[i, tok] > 0
