"""Speculate.width (protocol v9): the worker verifies only `width` < K drafts per request (batch-size-aware K).

The draft then proposes width-token speculations (-1 after them, zero q rows there) -- from its backup and
from cache entries built for a wider verify -- and builds its cache for a width-token verify: outcomes
j = 0 .. width, the all-accepted one ("width accepted") keyed with the draft's own next token among its
guesses, entries width tokens long.  Real DraftEngine on the tiny draft of the draft tests, through the
wire format; the tokens are checked against the sequential greedy decode, q against a recomputation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_ssd.draft.engine import DraftEngine
from sglang_ssd.protocol import PROTOCOL_VERSION, Hello, Prefill, Speculate, decode
from tests.draft_helpers import FAN, K, V, check_q
from tests.draft_helpers import model_dir, runner  # noqa: F401  (fixtures)
from tests.tiny_models import greedy_reference, next_logits

# proposals are compared with the draft's own decode: the prompt lookup off (conftest.no_lookup)
pytestmark = pytest.mark.usefixtures("no_lookup")

torch.set_num_threads(1)

PROMPTS = {"r0": [5, 9, 17, 33, 2], "r1": [40, 41], "r2": [7, 8, 9, 10, 11, 12, 13]}
TEMPS = {"r0": 0.0, "r1": 0.0, "r2": 0.8}
BONUS = {"r0": 3, "r1": 50, "r2": 21}
RIDS = list(PROMPTS)


def _wire(reply):
    return decode([bytes(f) for f in reply.encode()])


def _engine(runner, mode: str = "async") -> DraftEngine:
    e = DraftEngine(runner, seed=5, build_chunk_tokens=0)
    e.hello(Hello(PROTOCOL_VERSION, "w", K, mode, FAN, V, [], FAN))
    e.prefill(Prefill(RIDS, list(PROMPTS.values()), [TEMPS[r] for r in RIDS]))
    return e


def _ask(e, round_id, outcomes, width):
    msg = Speculate(round_id, RIDS, [outcomes[r][0] for r in RIDS], [outcomes[r][1] for r in RIDS],
                    [TEMPS[r] for r in RIDS], width=width)
    return _wire(e.speculate(_wire(msg)))


def _check_rows(runner, reply, ctx, width):
    for i, r in enumerate(RIDS):
        row = reply.tokens[i].tolist()
        assert row[width:] == [-1] * (K - width) and min(row[:width]) >= 0, (r, row)
        if TEMPS[r] == 0:
            assert row[:width] == greedy_reference(runner, ctx[r], width), r
    q = reply.q_for_row(2, V)
    check_q(runner, ctx["r2"], reply.tokens[2, :width].tolist(), q[:width], TEMPS["r2"])
    assert not q[width:].any()


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("width", [1, 2])
def test_backup_proposes_width_tokens(runner, mode, width):
    e = _engine(runner, mode)
    reply = _ask(e, 0, {r: (-1, BONUS[r]) for r in RIDS}, width)
    ctx = {r: PROMPTS[r] + [BONUS[r]] for r in RIDS}
    assert not reply.hit.any()
    _check_rows(runner, reply, ctx, width)
    for i, r in enumerate(RIDS):
        assert e.requests[r].last_spec == reply.tokens[i, :width].tolist()
    # an outcome past the proposed width is refused
    with pytest.raises(Exception, match="usable length"):
        _ask(e, 1, {r: (width + 1, 1) for r in RIDS}, width)


def test_cache_is_built_for_the_verify_width(runner):
    width = 1
    e = _engine(runner)
    reply = _ask(e, 0, {r: (-1, BONUS[r]) for r in RIDS}, width)
    ctx = {r: PROMPTS[r] + [BONUS[r]] for r in RIDS}
    spec = {r: reply.tokens[i, :width].tolist() for i, r in enumerate(RIDS)}
    e.build_cache()
    assert e.stats.builds_cut == 0  # a build to the verify's width is complete, not cut
    for r in RIDS:
        keys = e.cache.keys(r)
        assert {j for j, _ in keys} == set(range(width + 1)), (r, keys)
        for j, b in keys:
            entry = e.cache.peek(r, j, b)
            toks = entry.tokens.tolist()
            assert toks[width:] == [-1] * (K - width) and min(toks[:width]) >= 0
            start = ctx[r] + spec[r][:j] + [b]
            if TEMPS[r] == 0:
                assert toks[:width] == greedy_reference(runner, start, width), (r, j, b)
            else:
                check_q(runner, start, toks[:width], entry.q16[:width].cpu(), TEMPS[r])
                assert not entry.q16[width:].any()
    # j = 0: the proposed s_1 is excluded (a rejection there); j = width: all accepted, the bonus is the
    # target's next token after s_1..s_w, so the draft's own top tokens there are guessed, none excluded
    z0 = next_logits(runner, ctx["r0"])
    z0[spec["r0"][0]] = -float("inf")
    assert {b for j, b in e.cache.keys("r0") if j == 0} == set(torch.topk(z0, FAN[0]).indices.tolist())
    z1 = next_logits(runner, ctx["r0"] + spec["r0"])
    want = set(torch.topk(z1, max(FAN[width:])).indices.tolist())
    assert {b for j, b in e.cache.keys("r0") if j == width} == want
    assert int(z1.argmax()) in want

    # the all-accepted outcome of r0 is a hit: a width-token speculation from the new context
    b = int(z1.argmax())
    outcomes = {"r0": (width, b), "r1": e.cache.keys("r1")[0], "r2": e.cache.keys("r2")[-1]}
    reply = _ask(e, 1, outcomes, width)
    assert reply.hit.all()
    for r in RIDS:
        j, bb = outcomes[r]
        ctx[r] += spec[r][:j] + [bb]
    _check_rows(runner, reply, ctx, width)


def test_a_wider_entry_is_cut_to_the_width_and_a_short_one_stays_short(runner):
    """Entries built for K, asked with width 1: their first drafts (q rows past it zero); entries built for
    width 1, asked with K: 1-token speculations (the worker verifies what is there)."""
    e = _engine(runner)
    reply = _ask(e, 0, {r: (-1, BONUS[r]) for r in RIDS}, 0)  # width 0 = K
    assert (reply.tokens >= 0).all()
    ctx = {r: PROMPTS[r] + [BONUS[r]] for r in RIDS}
    spec = {r: reply.tokens[i].tolist() for i, r in enumerate(RIDS)}
    e.build_cache()
    outcomes = {r: e.cache.keys(r)[0] for r in RIDS}
    full = {r: e.cache.peek(r, *outcomes[r]) for r in RIDS}
    reply = _ask(e, 1, outcomes, 1)
    assert reply.hit.all()
    for i, r in enumerate(RIDS):
        j, b = outcomes[r]
        ctx[r] += spec[r][:j] + [b]
        assert reply.tokens[i].tolist() == full[r].tokens[:1].tolist() + [-1] * (K - 1)
    q = reply.q_for_row(2, V)
    assert np.array_equal(q[0], full["r2"].q16[0].cpu().numpy()) and not q[1:].any()
    _check_rows(runner, reply, ctx, 1)
    spec = {r: reply.tokens[i, :1].tolist() for i, r in enumerate(RIDS)}

    e.build_cache()  # built for width 1
    outcomes = {r: e.cache.keys(r)[-1] for r in RIDS}
    reply = _ask(e, 2, outcomes, 0)  # the batch shrank: K asked, 1-token entries served as they are
    assert reply.hit.all()
    for r in RIDS:
        j, b = outcomes[r]
        ctx[r] += spec[r][:j] + [b]
    _check_rows(runner, reply, ctx, 1)


def test_a_new_session_with_a_smaller_k_forgets_the_old_width(runner):
    """A width from an old session (K = 3) must not outlive it: a new Hello with K = 2 and its round-0 build
    (Prefill.round0) build 2-deep entries, not 3."""
    e = _engine(runner)
    _ask(e, 0, {r: (-1, BONUS[r]) for r in RIDS}, 3)
    assert e.width == 3
    fan2 = [2, 1, 2]
    e.hello(Hello(PROTOCOL_VERSION, "w2", 2, "async", fan2, V, [], fan2))
    assert e.width is None
    e.prefill(Prefill(["a"], [PROMPTS["r0"]], [0.0], round0=True))
    e.build_cache()
    keys = e.cache.keys("a")
    assert keys and e.stats.builds_cut == 0
    for j, b in keys:
        toks = e.cache.peek("a", j, b).tokens.tolist()
        assert len(toks) == 2 and toks == greedy_reference(runner, PROMPTS["r0"] + [b], 2)


def test_fitted_fan_out_learns_from_short_verifies_and_plans_for_the_width(runner):
    """fan_out_auto with width 1 (every speculation one draft long): the planner counts the rows (k = 0 a
    rejection, k = 1 a censored accept: the estimator's cap), and the cache for a 1-draft verify is built
    with the 1-draft plan over outcomes j = 0, 1 with the whole budget, not the K-plan's first entries."""
    fan = [2, 2, 2, 2]
    e = DraftEngine(runner, seed=5, build_chunk_tokens=0)
    e.hello(Hello(PROTOCOL_VERSION, "w", K, "async", fan, V, [], fan, "neural", True))
    e.fanout.planner.refresh_every = 6
    e.prefill(Prefill(RIDS, list(PROMPTS.values()), [TEMPS[r] for r in RIDS]))
    _ask(e, 0, {r: (-1, BONUS[r]) for r in RIDS}, 1)
    for rnd in range(1, 9):
        e.build_cache()
        for r in RIDS:  # the cache just built: the plan for a 1-draft verify of the row's source
            st = e.requests[r]
            want = e.fanout.schedule_for(st.last_hit, 1)
            assert st.cache_fan == want and len(want) == 2 and sum(want) == sum(fan), (r, st.cache_fan)
            assert {j for j, _ in e.cache.keys(r)} == {0, 1}
        # r0 always accepts its draft (a hit on the all-accepted outcome when cached), the others reject
        outcomes = {}
        for r in RIDS:
            keys = e.cache.keys(r)
            outcomes[r] = next((key for key in keys if key[0] == (1 if r == "r0" else 0)), keys[0])
        _ask(e, rnd, outcomes, 1)
    assert e.fanout.planner.observations == 3 * 8  # every 1-draft row counted (they were skipped before)
    a = e.fanout.planner.acceptance
    assert a.counts["primary"].acc + a.counts["backup"].acc > 0 and a.counts["primary"].rej + a.counts["backup"].rej > 0


def test_fan_out_by_width_off_restores_the_k_plan(runner, monkeypatch):
    """SGLANG_SSD_FAN_OUT_BY_WIDTH=0 (the A/B switch): 1-draft rows are not fed to the fit and the build
    takes the K-plan's F_0 and max(F_1..F_K); a bad value stops the engine at the Hello."""
    from sglang_ssd.draft.fanout import BY_WIDTH_ENV

    monkeypatch.setenv(BY_WIDTH_ENV, "0")
    fan = [3, 2, 2, 1]
    e = DraftEngine(runner, seed=5, build_chunk_tokens=0)
    e.hello(Hello(PROTOCOL_VERSION, "w", K, "async", fan, V, [], fan, "neural", True))
    e.prefill(Prefill(RIDS, list(PROMPTS.values()), [TEMPS[r] for r in RIDS]))
    _ask(e, 0, {r: (-1, BONUS[r]) for r in RIDS}, 1)
    for rnd in range(1, 4):
        e.build_cache()
        for r in RIDS:
            p = e.session.fan_out if e.requests[r].last_hit else e.session.fan_out_miss
            assert e.requests[r].cache_fan == [p[0], max(p[1:])]
        _ask(e, rnd, {r: e.cache.keys(r)[0] for r in RIDS}, 1)
    assert e.fanout.planner.observations == 0
    monkeypatch.setenv(BY_WIDTH_ENV, "maybe")
    with pytest.raises(ValueError, match=BY_WIDTH_ENV):
        DraftEngine(runner, seed=5).hello(Hello(PROTOCOL_VERSION, "w", K, "async", fan, V, [], fan, "neural", True))
