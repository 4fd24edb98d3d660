"""The next Speculate sent right after a verify (sglang/ahead.py): the worker's real DraftLink against a real
draft server, a greedy target whose output is known.  The next round uses the ahead reply's rows for the
requests SGLang committed as sent, asks the draft the ordinary way for the others (a new request, a row
committed differently, which is re-prefilled) in the same round, releases departed ones; a late ahead reply is
a deadline miss that keeps the session; an early prefill waits for it first.  Whenever the draft answers, its
context equals what was committed."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from tests.test_draft_link_late import DEADLINE, K, _answered, link_setup
from tests.tiny_models import greedy_reference


@pytest.fixture()
def setup(request):
    yield from link_setup(getattr(request, "param", "async"))


def _round(draft, link, target, send=True):
    """One decode round as SaguaroWorker._decode runs it: speculate, verify, send ahead, record."""
    t0 = time.monotonic()
    prop = link.speculate(target.reqs, [0.0] * len(target.reqs))
    took = time.monotonic() - t0
    if int(prop.max_accept.max()) > 0:
        for r in target.reqs:
            assert draft.server.engine.requests[r.rid].tokens == r.origin_input_ids + r.output_ids
    accepted = target.verify(prop)
    lens = [a + 1 for a in accepted]
    sent = send and link.send_ahead(target.reqs, lens, [r.output_ids[-n:] + [0] * (K + 1 - n)
                                                        for r, n in zip(target.reqs, lens)], [0.0] * len(lens))
    link.record(lens)
    time.sleep(0.03)  # SGLang's work between rounds, then the next round's forward
    return prop, took, sent


@pytest.mark.parametrize("setup", ["async", "sync"], indirect=True)
def test_ahead_replies_serve_the_next_round(setup):
    draft, link, target = setup
    rids = [r.rid for r in target.reqs]
    _, _, sent = _round(draft, link, target)
    assert sent  # the first round's reply put every row in step
    hits = 0
    for _ in range(8):
        prop, took, sent = _round(draft, link, target)
        assert sent and _answered(prop) and took < DEADLINE
        hits += int(prop.hit.sum())
    s = link.as_dict()
    assert s["ahead_sent"] == 9 and s["ahead_rows_used"] == 8 * len(rids) and s["ahead_rows_dropped"] == 0
    assert draft.prefilled == [rids] and s["deadline_misses"] == 0 and s["errors"] == 0
    assert hits > 0 or link.cfg.mode == "sync"
    assert len(draft.ks) in (9, 10)  # one Speculate per round (+ the last round's ahead): none asked twice


def test_batch_changes_a_new_row_a_departed_row_and_a_row_committed_differently(setup):
    draft, link, target = setup
    for _ in range(3):
        _round(draft, link, target)
    # "c" finished, "d" joins, and "b" was committed one token shorter than the ahead Speculate said
    target.reqs = [r for r in target.reqs if r.rid != "c"]
    target.ref["d"] = greedy_reference(draft.server.engine.runner, [3, 4, 5], 150)
    target.reqs.append(SimpleNamespace(rid="d", origin_input_ids=[3, 4, 5], output_ids=[target.ref["d"][0]],
                                       sampling_params=None))
    b = target.reqs[1]
    b.output_ids = b.output_ids[:-1]
    prop, took, _ = _round(draft, link, target)
    assert _answered(prop) and took < 2 * DEADLINE
    assert sorted(draft.prefilled[-1]) == ["b", "d"]  # both asked the ordinary way, in the same round
    s = link.as_dict()
    assert s["ahead_rows_used"] == 2 * 3 + 1 and s["ahead_rows_dropped"] == 1
    assert set(draft.server.engine.requests) == {"a", "b", "d"} and set(link.states) == {"a", "b", "d"}
    for _ in range(3):
        prop, _, sent = _round(draft, link, target)
        assert sent and _answered(prop)


def test_a_late_ahead_reply_is_a_deadline_miss_that_keeps_the_session(setup):
    draft, link, target = setup
    rids = [r.rid for r in target.reqs]
    for _ in range(2):
        _round(draft, link, target)
    # the draft must have taken up the second round's ahead Speculate (round 1's ordinary one, its ahead,
    # round 2's ahead) before the delay is armed, else the delay lands on that one, a round early
    deadline = time.monotonic() + 30
    while len(draft.ks) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(draft.ks) == 3, draft.ks
    draft.delay = 0.8  # the ahead Speculate the next round sends is answered late
    _round(draft, link, target)
    prop, took, sent = _round(draft, link, target)
    assert prop.max_accept.tolist() == [0] * 3 and DEADLINE - 0.05 < took < DEADLINE + 0.3 and not sent
    assert link.stats.deadline_misses == 1 and link.client_ok
    prop, took, _ = _round(draft, link, target)  # waits (bounded) for the late reply, then speculates
    # the draft was told k = 0 (the target-only round) for the proposal it made late; the next entry is the
    # ahead Speculate this round sent after its verify
    assert _answered(prop) and took < 2 * DEADLINE and draft.ks[-2] == [0, 0, 0]
    for _ in range(3):
        prop, _, sent = _round(draft, link, target)
        assert sent and _answered(prop)
    s = link.as_dict()
    assert s["late_replies_discarded"] == 1 and s["resets"] == 0 and s["errors"] == 0
    assert draft.prefilled == [rids]


def test_early_prefill_takes_the_ahead_reply_first_and_release_waits_for_it(setup):
    draft, link, target = setup
    for _ in range(2):
        _round(draft, link, target)
    assert link._ahead is not None  # outstanding after the last verify
    new = SimpleNamespace(rid="e", origin_input_ids=[9, 8, 7, 6], output_ids=[], sampling_params=None)
    assert link.prefill_early([new], [0.0]) == 1  # the ahead reply was taken first, then the Prefill went out
    assert link._ahead is not None and link._ahead.reply is not None
    link.settle_early()
    link.release(["c"])
    target.reqs = [r for r in target.reqs if r.rid != "c"]
    prop, _, sent = _round(draft, link, target)
    assert _answered(prop) and sent and "c" not in draft.server.engine.requests
    assert link.as_dict()["ahead_rows_used"] == 1 * 3 + 2


def test_release_after_the_last_round_takes_the_ahead_reply_and_frees_the_draft(setup):
    """A finished request's last round sends an ahead Speculate; its release must not wait for a next round
    (an idle server has none): it takes the reply and the draft holds nothing afterwards."""
    draft, link, target = setup
    for _ in range(3):
        _round(draft, link, target)
    assert link._late is not None and link._late.kind == "ahead"
    link.release([r.rid for r in target.reqs])
    assert not draft.server.engine.requests and not link.states and link._late is None
