"""Draft engine: what answers a cache miss (fast: n-gram copies / random tokens with their true q; hybrid:
model tokens then copies) and the fitted fan-out (fan_out_auto) refitting the schedule it builds with."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from sglang_ssd.draft.engine import DraftEngine
from sglang_ssd.protocol import PROTOCOL_VERSION, Hello
from sglang_ssd.saguaro.proposal import dequantize_proposal
from tests.draft_helpers import FAN, K, PROMPTS, V, Target, check_q, pick_outcome
from tests.draft_helpers import model_dir, runner  # noqa: F401  (fixtures)
from tests.tiny_models import greedy_reference

# proposals are compared with the draft's own decode: the prompt lookup off (conftest.no_lookup)
pytestmark = pytest.mark.usefixtures("no_lookup")


def test_fast_backup_proposes_ngram_copies_with_their_true_q(runner):
    """backup='fast': missed rows get prompt-lookup copies (one-hot q) or uniform random tokens (uniform q),
    no draft forward on the critical path; 'auto' starts neural at batch 1."""
    from sglang_ssd.saguaro.ngram import NgramSpeculator

    temps = {"r0": 1.0, "r1": 0.0, "r2": 0.8}
    e = DraftEngine(runner, seed=4)
    e.hello(Hello(PROTOCOL_VERSION, "t", K, "sync", FAN, V, [1], None, "fast"))
    t = Target(e, temps)
    calls = runner.forward_calls
    rids, reply = t.step({r: (-1, PROMPTS[r][1]) for r in PROMPTS})  # r2's prompt repeats 8: a 1-gram match
    assert runner.forward_calls == calls
    for i, r in enumerate(rids):
        want, is_random = NgramSpeculator(4, 1).propose(t.ctx[r], K, V)
        got = t.spec[r]
        assert [g for g, rnd in zip(got, is_random) if not rnd] == [w for w, rnd in zip(want, is_random) if not rnd]
        q = reply.q_for_row(i, V)
        if temps[r] == 0:
            assert q is None
            continue
        q = dequantize_proposal(torch.as_tensor(np.asarray(q)))
        for j, rnd in enumerate(is_random):
            if rnd:
                assert torch.allclose(q[j], torch.full((V,), 1.0 / V))
            else:
                assert q[j, got[j]] == 1.0
    assert e.health()["fast_backup_rows"] == 3 and e.health()["neural_backup_rows"] == 0
    e2 = DraftEngine(runner, seed=4)
    e2.hello(Hello(PROTOCOL_VERSION, "t", K, "async", FAN, V, [1], None, "auto"))
    t2 = Target(e2, temps)
    t2.step({r: (-1, 3) for r in PROMPTS})
    assert e2.health()["neural_backup_rows"] == 3 and e2.backups.choose(1) == "neural"
    with pytest.raises(Exception, match="backup"):
        Hello(PROTOCOL_VERSION, "t", K, "sync", FAN, V, [1], None, "magic").encode()


@pytest.mark.parametrize("setting,temps,steps", [
    ("1", {"r0": 1.0, "r1": 0.0, "r2": 0.8}, 1), ("2", {"r0": 1.0, "r1": 0.0, "r2": 0.8}, 2),
    ("auto", {"r0": 1.0, "r1": 0.0, "r2": 0.8}, 2),  # a sampled missed row: two model tokens
    ("auto", {"r0": 0.0, "r1": 0.0, "r2": 0.0}, 1)])  # every row greedy: one
def test_hybrid_backup_is_model_tokens_then_ngram_copies(runner, monkeypatch, setting, temps, steps):
    """backup='hybrid': one draft forward per model token (SGLANG_SSD_HYBRID_STEPS: auto = 2 in a round with
    a sampled missed row, else 1); positions 0..steps-1 = the draft's own tokens (greedy: the argmax;
    sampled: q = its softmax), the rest = NgramIndex.propose_after(those tokens) with one-hot / uniform q."""
    from sglang_ssd.draft.backup import HYBRID_STEPS_ENV
    from sglang_ssd.saguaro.ngram import NgramIndex

    monkeypatch.setenv(HYBRID_STEPS_ENV, setting)
    e = DraftEngine(runner, seed=5)
    e.hello(Hello(PROTOCOL_VERSION, "t", K, "sync", FAN, V, [1], None, "hybrid"))
    t = Target(e, temps)
    rng = random.Random(5)
    outcomes = {r: (-1, PROMPTS[r][1]) for r in PROMPTS}
    for rnd in range(3):
        calls = runner.forward_calls
        rids, reply = t.step(outcomes)
        assert runner.forward_calls == calls + steps and reply.fast_rows == 3
        for i, r in enumerate(rids):
            got = t.spec[r]
            want, is_random = NgramIndex(4, 1, tokens=t.ctx[r]).propose_after(got[:steps], K - steps, V)
            tail = got[steps:]
            assert [g for g, x in zip(tail, is_random) if not x] == [w for w, x in zip(want, is_random) if not x]
            q = reply.q_for_row(i, V)
            if temps[r] == 0:
                assert got[:steps] == greedy_reference(runner, t.ctx[r], steps) and q is None
                continue
            check_q(runner, t.ctx[r], got[:steps], np.asarray(q)[:steps], temps[r],
                    fs=e.session.fan_out_miss[:steps])
            q = dequantize_proposal(torch.as_tensor(np.asarray(q)))
            for j, x in enumerate(is_random, start=steps):
                assert torch.allclose(q[j], torch.full((V,), 1.0 / V)) if x else q[j, got[j]] == 1.0
        outcomes = {r: (rng.randint(-1, K), rng.randrange(V)) for r in PROMPTS}
    h = e.health()
    assert h["hybrid_backup_rows"] == 9 and h["neural_backup_rows"] == 0 and h["fast_backup_rows"] == 0
    monkeypatch.setenv(HYBRID_STEPS_ENV, "0")  # a bad setting stops the draft at start, not in a round
    with pytest.raises(ValueError, match=HYBRID_STEPS_ENV):
        DraftEngine(runner, seed=5)


def test_fan_out_auto_refits_the_schedule_and_builds_with_it(runner):
    """fan_out_auto: rows feed the planner; after a refresh the session's schedules change (same budget),
    the next caches are built with them, and health / the stats command report the fit."""
    from sglang_ssd.draft.stats import format_health

    temps = {r: 0.0 for r in PROMPTS}
    e = DraftEngine(runner, seed=5)
    e.hello(Hello(PROTOCOL_VERSION, "t", K, "async", [2, 2, 2, 2], V, [1], None, "neural", True))
    assert sum(e.session.fan_out) == 8 and len(e.session.fan_out) == K + 1
    e.fanout.planner.refresh_every = 12
    t = Target(e, temps)
    rng = random.Random(5)
    outcomes = {r: (-1, 3) for r in PROMPTS}
    schedules = set()
    for rnd in range(30):
        t.step(outcomes)
        schedules.add((tuple(e.session.fan_out), tuple(e.session.fan_out_miss)))
        for r in PROMPTS:  # the cache just built follows the current schedule of the row's source
            fan = e.session.fan_out if e.requests[r].last_hit else e.session.fan_out_miss
            assert e.requests[r].cache_fan == list(fan)
        outcomes = {r: pick_outcome(rng, e, r, t.spec[r], "hit" if rnd % 3 else "miss")[0] for r in PROMPTS}
    assert all(sum(p) == 8 and sum(b) == 8 for p, b in schedules)
    assert len(schedules) >= 2  # re-planned at least once
    h = e.health()
    assert h["fanout_observations"] >= 80 and 0 < h["fanout_primary_a"] < 1
    assert 0 <= h["fanout_primary_measured_hit"] <= 1
    text = format_health(h)
    assert "primary" in text and "F = [" in text
    # the same worker reconnecting with its session's ORIGINAL Hello resumes it: requests, KV, cache and
    # the fitted fan-outs are kept (the Hello's fan_out is compared as sent, not as re-fitted)
    fitted, entries, planner = (e.session.fan_out, e.session.fan_out_miss), e.cache.num_entries(), e.fanout
    reply = e.hello(Hello(PROTOCOL_VERSION, "t", K, "async", [2, 2, 2, 2], V, [1], None, "neural", True))
    assert reply.resumed and set(e.requests) == set(PROMPTS) and e.cache.num_entries() == entries > 0
    assert (e.session.fan_out, e.session.fan_out_miss) == fitted and e.fanout is planner
    t.step(outcomes)  # and carries on where it was (Target checks every request's context)
    # any other Hello (here: other eos ids) starts a fresh session
    reply = e.hello(Hello(PROTOCOL_VERSION, "t", K, "async", [2, 2, 2, 2], V, [], None, "neural", True))
    assert not reply.resumed and not e.requests and e.cache.num_entries() == 0
    assert e.fanout is not planner and sum(e.session.fan_out) == 8  # a new planner, fit from scratch
