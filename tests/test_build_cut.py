"""Issue 14 item 2: the target never waits for a cache build.

The build stops as soon as a message is waiting: entries finished to depth d < K are served as d-token
speculations (-1 padded, zero q rows past d), a build cut before depth 1 stores nothing (-> miss ->
backup), and the server answers a Speculate that arrives mid-build at once (the build is cut and
counted).  Real DraftEngine / DraftServer on a tiny random model."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
import torch

from sglang_ssd.draft.client import DraftClient
from sglang_ssd.draft.engine import DraftEngine, EngineError
from sglang_ssd.draft.runner import DraftRunner
from sglang_ssd.draft.server import DraftServer
from sglang_ssd.protocol import PROTOCOL_VERSION, Hello, Prefill, Speculate, decode
from tests.draft_helpers import FAN, K, V, check_q
from tests.draft_helpers import model_dir, runner  # noqa: F401  (fixtures: the tiny draft of the draft tests)
from tests.tiny_models import greedy_reference, next_logits

# proposals are compared with the draft's own decode: the prompt lookup off (conftest.no_lookup)
pytestmark = pytest.mark.usefixtures("no_lookup")

torch.set_num_threads(1)

PROMPTS = {"r0": [5, 9, 17, 33, 2], "r1": [40, 41], "r2": [7, 8, 9, 10, 11, 12, 13]}
TEMPS = {"r0": 0.0, "r1": 0.0, "r2": 0.8}
BONUS = {"r0": 3, "r1": 50, "r2": 21}
RIDS = list(PROMPTS)


class Stopper:
    """should_stop that says "a message is waiting" from its n-th call on (1 = before the glue,
    2 = after it, then after every chunk of every depth but the last)."""

    def __init__(self, n: int):
        self.n, self.calls = n, 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.calls >= self.n


def _wire(reply):
    return decode([bytes(f) for f in reply.encode()])


def _start(runner, chunk: int = 0, **kw):
    """Engine after round 0 (all backup): -> engine, contexts, last speculations."""
    e = DraftEngine(runner, seed=3, build_chunk_tokens=chunk, **kw)
    e.hello(Hello(PROTOCOL_VERSION, "t", K, "async", FAN, V, [], FAN))
    e.prefill(Prefill(RIDS, list(PROMPTS.values()), [TEMPS[r] for r in RIDS]))
    reply = _wire(e.speculate(Speculate(0, RIDS, [-1] * 3, [BONUS[r] for r in RIDS], [TEMPS[r] for r in RIDS])))
    ctx = {r: PROMPTS[r] + [BONUS[r]] for r in RIDS}
    spec = {r: reply.tokens[i].tolist() for i, r in enumerate(RIDS)}
    return e, ctx, spec


def _check_entries(runner, e, ctx, spec, rid, depth):
    """Every cached entry of rid: `depth` tokens of the sequential decode (greedy) or drawn from the
    sequential softmax (sampled), then -1; q rows past `depth` are zero."""
    keys = e.cache.keys(rid)
    assert keys
    for j, b in keys:
        entry = e.cache.peek(rid, j, b)
        toks = entry.tokens.tolist()
        assert toks[depth:] == [-1] * (K - depth), (rid, j, b, toks)
        start = ctx[rid] + spec[rid][:j] + [b]
        if TEMPS[rid] == 0:
            assert entry.q16 is None
            assert toks[:depth] == greedy_reference(runner, start, depth), (rid, j, b)
        else:
            check_q(runner, start, toks[:depth], entry.q16[:depth].cpu(), TEMPS[rid])
            assert not entry.q16[depth:].any()


@pytest.mark.parametrize("depth", [1, 2])
def test_build_cut_after_depth_d_serves_d_token_speculations(runner, depth):
    e, ctx, spec = _start(runner)
    stop = Stopper(2 + depth)
    e.build_cache(stop)
    assert stop.calls == 2 + depth
    assert e.stats.builds_cut == 1 and e.stats.cut_depth_hist == {depth: 1}
    h = e.health()
    assert h["builds_cut"] == 1 and h[f"cut_depth_{depth}"] == 1 and h["builds_cut_before_glue"] == 0
    for r in RIDS:
        _check_entries(runner, e, ctx, spec, r, depth)

    # a hit on a short entry: `depth` tokens + -1 padding, q rows of the entry, zeros past depth
    outcome = {r: e.cache.keys(r)[-1] for r in RIDS}
    entries = {r: e.cache.peek(r, *outcome[r]) for r in RIDS}
    msg = Speculate(1, RIDS, [outcome[r][0] for r in RIDS], [outcome[r][1] for r in RIDS], [TEMPS[r] for r in RIDS])
    reply = _wire(e.speculate(msg))
    assert reply.hit.all()
    for i, r in enumerate(RIDS):
        j, b = outcome[r]
        ctx[r] += spec[r][:j] + [b]
        row = reply.tokens[i].tolist()
        assert row == entries[r].tokens.tolist() and row[depth:] == [-1] * (K - depth)
        spec[r] = row[:depth]
        assert e.requests[r].last_spec == spec[r] and e.requests[r].tokens == ctx[r]
    assert reply.q_rows.tolist() == [2]
    q = reply.q_for_row(2, V)
    assert np.array_equal(q[:depth], entries["r2"].q16[:depth].cpu().numpy()) and not q[depth:].any()

    # the next round builds from the short speculation: glue over [root, s_1..s_depth], forks at j <= depth
    e.build_cache()
    assert e.stats.builds_cut == 1
    for r in RIDS:
        keys = e.cache.keys(r)
        assert {j for j, _ in keys} == set(range(depth + 1)), (r, keys)
        for j, b in keys:
            tokens = e.cache.peek(r, j, b).tokens.tolist()
            assert min(tokens) >= 0
            if TEMPS[r] == 0:
                assert tokens == greedy_reference(runner, ctx[r] + spec[r][:j] + [b], K), (r, j, b)
    # guesses at j < depth exclude the proposed s_{j+1}; at j = depth ("all accepted") none is excluded
    z = next_logits(runner, ctx["r0"] + spec["r0"])
    want = set(torch.topk(z, max(FAN[depth:])).indices.tolist())
    assert {b for j, b in e.cache.keys("r0") if j == depth} == want

    # k beyond the usable length of the last speculation is refused, nothing changed
    before = list(e.requests["r0"].tokens)
    with pytest.raises(EngineError):
        e.speculate(Speculate(2, ["r0"], [depth + 1], [1], [0.0]))
    assert e.requests["r0"].tokens == before

    # the all-accepted outcome of the short speculation is a hit with K real tokens
    b = next(b for j, b in e.cache.keys("r0") if j == depth)
    reply = _wire(e.speculate(Speculate(2, ["r0"], [depth], [b], [0.0])))
    assert reply.hit.all() and reply.tokens.min() >= 0
    assert reply.tokens[0].tolist() == greedy_reference(runner, ctx["r0"] + spec["r0"] + [b], K)


def test_cut_inside_a_depth_keeps_the_finished_chunks(runner):
    # one request per chunk: calls 1 before glue, 2 after, 3..5 after r0/r1/r2 of depth 0, 6 after r0 of depth 1
    e, ctx, spec = _start(runner, chunk=1)
    e.build_cache(Stopper(6))
    assert e.stats.cut_depth_hist == {1: 1}
    for r, d in zip(RIDS, (2, 1, 1)):
        _check_entries(runner, e, ctx, spec, r, d)


@pytest.mark.parametrize("how", ["before glue", "after glue", "max depth 0"])
def test_cut_before_depth_1_stores_nothing_and_the_next_round_backs_up(runner, how):
    e, ctx, spec = _start(runner, max_build_depth=0 if how == "max depth 0" else None)
    e.build_cache(Stopper({"before glue": 1, "after glue": 2}.get(how, 99)))
    assert e.cache.num_entries() == 0
    assert e.stats.builds_cut == 1 and e.stats.cut_depth_hist == {0: 1}
    assert e.stats.builds_cut_before_glue == int(how == "before glue")
    assert all(st.cache_fan is None for st in e.requests.values())
    bonus = {r: (spec[r][0] + 1) % V for r in RIDS}  # k = 0, a bonus other than the rejected draft
    reply = _wire(e.speculate(Speculate(1, RIDS, [0] * 3, [bonus[r] for r in RIDS], [TEMPS[r] for r in RIDS])))
    assert not reply.hit.any() and e.stats.backup_rows == 6 and reply.tokens.min() >= 0
    for i, r in enumerate(RIDS):
        start = ctx[r] + [bonus[r]]
        if TEMPS[r] == 0:
            assert reply.tokens[i].tolist() == greedy_reference(runner, start, K)
        else:
            check_q(runner, start, reply.tokens[i].tolist(), reply.q_for_row(i, V), TEMPS[r])
    e.max_build_depth = None
    e.build_cache()  # and the round after is built in full again
    assert e.stats.builds_cut == 1 and all(e.cache.keys(r) for r in RIDS)


def test_server_answers_a_speculate_that_arrives_mid_build_at_once(model_dir, monkeypatch):
    runner = DraftRunner.from_dir(model_dir)
    real = runner.forward

    def slow(items, **kw):  # every forward takes >= 0.3 s: a full build (glue + K depths) >= 1.2 s
        time.sleep(0.3)
        return real(items, **kw)

    monkeypatch.setattr(runner, "forward", slow)
    server = DraftServer(DraftEngine(runner, build_chunk_tokens=0), f"ipc:///tmp/sglang-ssd-test-{uuid.uuid4().hex}.sock")
    server.start_in_thread()
    try:
        with DraftClient(server.endpoint, timeout_s=30) as c:
            c.hello(k=K, mode="async", fan_out=FAN, vocab_size=V)
            c.prefill(["r0"], [PROMPTS["r0"]], [0.0])
            first = c.speculate(0, ["r0"], [-1], [BONUS["r0"]], [0.0])
            # sent while the round-0 build runs: the build stops after the glue, the reply needs no build
            second = c.speculate(1, ["r0"], [0], [(int(first.tokens[0, 0]) + 1) % V], [0.0])
            assert not second.hit.any()
            h = c.health()  # arrives during the round-1 build: answered in passing, the build goes on
            assert h["builds"] == 1 and h["builds_cut"] == 1 and h["cut_depth_0"] == 1
            deadline = time.monotonic() + 30
            while h["builds"] < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
                h = c.health()
            assert h["builds"] == 2 and h["builds_cut"] == 1 and h["cache_entries"] == sum(FAN)
            assert server.engine.cache.keys("r0")
    finally:
        server.stop()
    assert not server._thread.is_alive()


def test_the_reply_leaves_before_the_build_starts(model_dir, monkeypatch):
    """send only queues a reply for ZeroMQ's I/O thread, which shares the draft's core: the server waits
    until that thread has taken the reply (its tracker is done) before it starts the cache build, so the
    target is not kept waiting by the build for a reply that was ready.  Every reply is tracked for real
    (copy_threshold 0: a small frame is not copied, so its tracker is not the pre-finished stand-in)."""
    runner = DraftRunner.from_dir(model_dir)
    server = DraftServer(DraftEngine(runner, build_chunk_tokens=0), f"ipc:///tmp/sglang-ssd-test-{uuid.uuid4().hex}.sock")
    sent, at_build = [], []
    real_send, real_build = server._send, server.engine.build_cache

    def send(ident, msg):
        real_send(ident, msg)
        sent.append((msg.TYPE, server._unflushed))

    def build(should_stop=None):
        at_build.append([(kind, t.done) for kind, t in sent[-1:]])
        return real_build(should_stop)

    monkeypatch.setattr(server, "_send", send)
    monkeypatch.setattr(server.engine, "build_cache", build)
    server.start_in_thread()
    try:
        with DraftClient(server.endpoint, timeout_s=30) as c:
            c.hello(k=K, mode="async", fan_out=FAN, vocab_size=V)
            c.prefill(["r0"], [PROMPTS["r0"]], [0.0])
            c.speculate(0, ["r0"], [-1], [BONUS["r0"]], [0.0])
            c.speculate(1, ["r0"], [0], [BONUS["r0"]], [0.0])
            c.health()
    finally:
        server.stop()
    assert server.sock.closed
    assert all(t is not None and len(t.events) > 0 for _, t in sent), sent  # really tracked
    assert at_build == [[("spec_reply", True)], [("spec_reply", True)]], at_build
