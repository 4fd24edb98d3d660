"""Draft engine: the SSD speculation cache against sequential references (greedy tokens, sampled q, Saguaro
sampling's sigma on every path), sync mode as plain SD, rejections leaving state untouched, and a reduced
head's q on the wire."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from sglang_ssd.draft.engine import DraftEngine, EngineError
from sglang_ssd.draft.runner import DraftRunner
from sglang_ssd.protocol import PROTOCOL_VERSION, Hello, Prefill, Release, Speculate
from sglang_ssd.saguaro.proposal import dequantize_proposal
from tests.draft_helpers import (FAN, FAN_MISS, K, KINDS, PROMPTS, V, Target, check_cache_greedy, check_q,
                                 pick_outcome)
from tests.draft_helpers import model_dir, runner  # noqa: F401  (fixtures)
from tests.tiny_models import greedy_reference, make_reduced_head_model

# proposals are compared with the draft's own decode: the prompt lookup off (conftest.no_lookup)
pytestmark = pytest.mark.usefixtures("no_lookup")


def test_async_greedy_cache_and_backup_equal_sequential_decode(runner):
    e = DraftEngine(runner, seed=0)
    e.hello(Hello(PROTOCOL_VERSION, "t", K, "async", FAN, V, [1], FAN_MISS))
    t = Target(e, {r: 0.0 for r in PROMPTS})
    rng = random.Random(0)
    outcomes = {r: (-1, 3 + i) for i, r in enumerate(PROMPTS)}
    expect = {r: False for r in PROMPTS}
    hits = 0
    for rnd in range(6):
        rids, reply = t.step(outcomes)
        for i, r in enumerate(rids):
            assert bool(reply.hit[i]) == expect[r], (rnd, r)
            assert reply.tokens[i].tolist() == greedy_reference(runner, t.ctx[r], K), (rnd, r)
        assert len(reply.q_rows) == 0 and reply.q.shape == (0, K, V)
        hits += int(reply.hit.sum())
        for r in PROMPTS:
            check_cache_greedy(runner, e, t, r)
        picked = {r: pick_outcome(rng, e, r, t.spec[r], KINDS[(rnd + i) % 6]) for i, r in enumerate(PROMPTS)}
        outcomes = {r: o for r, (o, _) in picked.items()}
        expect = {r: h for r, (_, h) in picked.items()}
    assert hits == 8  # rounds 1..5 x 3 rows, half of the kinds are "hit"
    h = e.health()
    assert h["hits"] == hits and h["rounds"] == 6 and h["live_requests"] == 3 and h["builds"] == 6


def test_async_sampled_q_matches_sequential_softmax(runner):
    temps = {"r0": 1.0, "r1": 0.7, "r2": 0.0}
    e = DraftEngine(runner, seed=1)
    e.hello(Hello(PROTOCOL_VERSION, "t", K, "async", FAN, V, [1]))
    t = Target(e, temps)
    rng = random.Random(1)
    outcomes = {r: (-1, 3) for r in PROMPTS}
    n_hit = 0
    for rnd in range(4):
        rids, reply = t.step(outcomes)
        assert reply.q_rows.tolist() == [0, 1]
        for i, r in enumerate(rids):
            if temps[r] > 0:
                check_q(runner, t.ctx[r], t.spec[r], reply.q_for_row(i, V), temps[r])
            else:
                assert t.spec[r] == greedy_reference(runner, t.ctx[r], K)
        n_hit += int(reply.hit[:2].sum())
        for r in ("r0", "r1"):  # every cached entry carries the q its tokens were drawn from
            for j, b in e.cache.keys(r):
                entry = e.cache.peek(r, j, b)
                check_q(runner, t.ctx[r] + t.spec[r][:j] + [b], entry.tokens.tolist(), entry.q16, temps[r])
        outcomes = {r: pick_outcome(rng, e, r, t.spec[r])[0] for r in PROMPTS}
    assert n_hit >= 1


def test_saguaro_sampling_q_is_sigma_of_softmax_on_every_path(runner):
    """Per-request C: backup rows are drawn from sigma_{F,C} with F = fan_out_miss[t], cached (hit) rows
    with F = fan_out[t]; C = 1 rows stay plain softmax; the q sent is exactly the one sampled from."""
    temps = {"r0": 1.0, "r1": 0.7, "r2": 1.0}
    cs = {"r0": 0.5, "r1": 0.2, "r2": 1.0}
    e = DraftEngine(runner, seed=3)
    e.hello(Hello(PROTOCOL_VERSION, "t", K, "async", FAN, V, [1], FAN_MISS))
    t = Target(e, temps, cs)
    assert [e.requests[r].saguaro_c for r in PROMPTS] == [0.5, 0.2, 1.0]
    rng = random.Random(3)
    outcomes = {r: (-1, 3) for r in PROMPTS}
    seen = set()
    for rnd in range(5):
        rids, reply = t.step(outcomes)
        for i, r in enumerate(rids):
            fs = FAN if reply.hit[i] else FAN_MISS
            seen.add(bool(reply.hit[i]))
            check_q(runner, t.ctx[r], t.spec[r], reply.q_for_row(i, V), temps[r], fs, cs[r])
            for j, b in e.cache.keys(r):
                entry = e.cache.peek(r, j, b)
                check_q(runner, t.ctx[r] + t.spec[r][:j] + [b], entry.tokens.tolist(), entry.q16, temps[r],
                        FAN, cs[r])
        outcomes = {r: pick_outcome(rng, e, r, t.spec[r], "hit" if rnd % 2 == 0 else "miss")[0] for r in PROMPTS}
    assert seen == {True, False}
    # sync mode ignores C (no cache to steer the bonus towards)
    e2 = DraftEngine(runner, seed=3)
    e2.hello(Hello(PROTOCOL_VERSION, "t", K, "sync", FAN, V))
    Target(e2, temps, cs)
    assert all(st.saguaro_c == 1.0 for st in e2.requests.values())


def test_sync_mode_is_plain_sd(runner):
    temps = {"r0": 0.0, "r1": 0.0, "r2": 1.0}
    e = DraftEngine(runner, seed=2)
    e.hello(Hello(PROTOCOL_VERSION, "t", K, "sync", FAN, V))
    t = Target(e, temps)
    rng = random.Random(2)
    outcomes = {r: (-1, 4) for r in PROMPTS}
    for _ in range(4):
        rids, reply = t.step(outcomes)
        assert not reply.hit.any() and e.cache.num_entries() == 0 and not e.pending
        for i, r in enumerate(rids):
            if temps[r] == 0:
                assert t.spec[r] == greedy_reference(runner, t.ctx[r], K)
            else:
                check_q(runner, t.ctx[r], t.spec[r], reply.q_for_row(i, V), 1.0)
        outcomes = {r: (rng.randint(-1, K), rng.randrange(V)) for r in PROMPTS}
    assert e.health()["backup_rows"] == 12


def test_rejections_leave_state_untouched(runner):
    e = DraftEngine(runner)
    with pytest.raises(EngineError, match="Hello"):
        e.prefill(Prefill(["a"], [[1]], [0.0]))
    with pytest.raises(EngineError, match="vocab"):
        e.hello(Hello(PROTOCOL_VERSION, "t", K, "async", FAN, V + 1))
    e.hello(Hello(PROTOCOL_VERSION, "t", K, "async", FAN, V))
    with pytest.raises(EngineError, match="vocab"):
        e.prefill(Prefill(["a"], [[V]], [0.0]))
    e.prefill(Prefill(["a", "b"], [[1, 2], [3]], [0.0, 0.0]))
    before = {r: list(s.tokens) for r, s in e.requests.items()}
    with pytest.raises(EngineError) as ei:
        e.speculate(Speculate(0, ["a", "ghost"], [-1, -1], [5, 5], [0.0, 0.0]))
    assert ei.value.rids == ["ghost"]
    with pytest.raises(EngineError) as ei:
        # a prefill counts as an empty speculation: k = 0 is b's only outcome before its first round
        e.speculate(Speculate(0, ["a", "b"], [-1, 1], [5, 5], [0.0, 0.0]))
    assert ei.value.rids == ["b"]
    with pytest.raises(EngineError, match="bonus"):
        e.speculate(Speculate(0, ["a"], [-1], [V], [0.0]))
    assert {r: s.tokens for r, s in e.requests.items()} == before and e.stats.rounds == 0
    e.speculate(Speculate(0, ["a"], [-1], [5], [0.0]))
    with pytest.raises(EngineError, match="k must"):
        e.speculate(Speculate(1, ["a"], [K + 1], [5], [0.0]))
    ack = e.release(Release(["a", "nobody"]))
    assert ack.count == 1 and "nobody" in ack.message and "a" not in e.requests and not e.pending
    # a new client resets everything
    e.hello(Hello(PROTOCOL_VERSION, "other", K, "async", FAN, V))
    assert not e.requests


# ---------------------------------------------------------------------------------------------
# client behaviour against a fake server: timeouts and late replies


def test_reduced_head_q_travels_over_the_head_ids_and_equals_the_dense_law():
    """A draft whose head covers 40 of the 96 ids (rows stored unsorted): sampling, cache storage and the
    wire carry q over those ids only (q_ids = the sorted head ids, width 40); scattered back it equals the
    sequential softmax over the full vocabulary (zero elsewhere), for cache hits and backups.  A fast
    backup's row may copy an id outside the head: that reply's q travels over the head's ids plus those
    (its random tokens are drawn from the head's ids), dense only when that is every id."""
    from sglang_ssd.draft.wire_q import wire_q
    from sglang_ssd.saguaro.ngram import NgramIndex

    head = random.Random(5).sample(range(V), 40)
    runner = DraftRunner.from_dir(make_reduced_head_model(head, vocab_size=V, seed=3))
    assert runner.n_cols == 40 and runner.cols.tolist() == sorted(head)
    temps = {"r0": 1.0, "r1": 0.7, "r2": 0.0}
    e = DraftEngine(runner, seed=2)
    e.hello(Hello(PROTOCOL_VERSION, "t", K, "async", FAN, V, [1]))
    t = Target(e, temps)
    rng = random.Random(2)
    outcomes = {r: (-1, 3) for r in PROMPTS}
    hits = 0
    for rnd in range(5):
        rids, reply = t.step(outcomes)
        assert reply.q_ids.tolist() == sorted(head) and reply.q.shape == (2, K, 40)
        for i, r in enumerate(rids):
            assert set(t.spec[r]) <= set(head)
            if temps[r] > 0:
                check_q(runner, t.ctx[r], t.spec[r], reply.q_for_row(i, V), temps[r])
            else:
                assert t.spec[r] == greedy_reference(runner, t.ctx[r], K)
        hits += int(reply.hit.sum())
        for r in rids:
            for j, b in e.cache.keys(r):
                entry = e.cache.peek(r, j, b)
                assert entry.q16 is None if temps[r] == 0 else entry.q16.shape == (K, 40)
        outcomes = {r: pick_outcome(rng, e, r, t.spec[r], "hit" if rnd % 2 == 0 else "miss")[0] for r in rids}
    assert hits >= 3
    e2 = DraftEngine(runner, seed=2)
    e2.hello(Hello(PROTOCOL_VERSION, "t", K, "sync", FAN, V, [1], None, "fast"))
    t2 = Target(e2, {"r0": 1.0, "r1": 0.0, "r2": 1.0})
    uniform = torch.zeros(V).index_fill_(0, torch.as_tensor(head), 1.0 / len(head))
    outcomes, widths = {r: (-1, PROMPTS[r][1]) for r in PROMPTS}, []
    for rnd in range(4):
        rids, reply = t2.step(outcomes)
        ids = reply.q_ids.tolist()
        assert ids == sorted(ids) and set(head) <= set(ids) and reply.q.shape == (2, K, len(ids))
        widths.append(len(ids))
        for i, r in enumerate(rids):
            if t2.temps[r] == 0:
                continue
            copies, is_random = NgramIndex(4, 1, tokens=t2.ctx[r]).propose(K, V)
            q = dequantize_proposal(torch.as_tensor(np.asarray(reply.q_for_row(i, V))))
            for j, (tok, x) in enumerate(zip(t2.spec[r], is_random)):
                if x:  # drawn from the head's ids, q uniform over them
                    assert tok in head and torch.equal(q[j], uniform)
                else:  # a copy (maybe of an id outside the head), q one-hot
                    assert tok == copies[j] and q[j, tok] == 1.0 and q[j].sum() == 1.0
        outcomes = {r: (rng.randint(-1, K), rng.randrange(V)) for r in rids}
    assert max(widths) > len(head) and min(widths) < V  # copies outside the head travelled, sparse
    # copies that use every id outside the head (one per row and depth): the reply goes dense, each copy
    # one-hot at its id and every row's values over the head's ids placed at those ids
    rest = [t for t in range(V) if t not in head]
    m = -(-len(rest) // K)
    rows = [torch.rand(K, len(head)).half() for _ in range(m)]
    outside = [(j // K, j % K, t) for j, t in enumerate(rest)]
    q, q_ids = wire_q(rows, K, runner.cols, V, e2._q_ids, outside)
    assert len(q_ids) == 0 and q.shape == (m, K, V)
    for r, d, t in outside:
        assert q[r, d, t] == 1.0
    cols = runner.cols.tolist()
    assert np.array_equal(q[:, :, cols], torch.stack(rows).numpy())
    assert np.count_nonzero(np.delete(q, cols, axis=2)) == len(rest)  # nothing else outside the head
