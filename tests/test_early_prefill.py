"""Draft prefill off the critical path (issue 14 item 5): the worker's real DraftLink sends the prompts
while the target prefills (Prefill.round0), the draft builds round 0's speculations for its top guesses
of the first token, and the first decode round reports k = 0 and can hit; a chunked prefill's middle
chunks send nothing; a failed early prefill falls back to the lazy prefill at round 1."""

from __future__ import annotations

import time

import pytest

from tests.test_draft_link_late import DEADLINE, _answered, _round, link_setup


@pytest.fixture()
def early(request):
    yield from link_setup(request.param)


def _prefill(link, target, delay=0.2):
    """What SaguaroWorker._prefill does: early Prefill, the target's prefill forward, settle."""
    first = {r.rid: r.output_ids for r in target.reqs}
    for r in target.reqs:
        r.output_ids = []  # during the prefill nothing is sampled yet
    sent = link.prefill_early(target.reqs, [0.0] * len(target.reqs))
    time.sleep(delay)  # the target's prefill forward
    for r in target.reqs:
        r.output_ids = first[r.rid]  # ... which samples the first token
    link.settle_early()
    return sent


@pytest.mark.parametrize("early", ["async"], indirect=True)
def test_round0_cache_hits_the_first_decode_round(early):
    draft, link, target = early
    assert _prefill(link, target) == 3
    assert [len(r) for r in draft.prefilled] == [3] and not link._late
    deadline = time.monotonic() + 30  # a slow host may need longer than the 0.2 s "prefill" for the build
    while draft.server.engine.stats.builds < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert draft.server.engine.stats.builds_cut == 0
    prop, took = _round(draft, link, target)
    assert draft.ks[0] == [0, 0, 0]  # an empty speculation's outcome: 0 accepted, the first token
    assert bool(prop.hit.all()) and _answered(prop) and took < DEADLINE  # target = draft: its top guess
    health = draft.server.engine.health()
    assert health["builds"] >= 1 and link.as_dict()["early_prefills"] == 3
    for _ in range(4):  # and speculation goes on from there, the draft in step with what was committed
        prop, _ = _round(draft, link, target)
        assert _answered(prop)
    assert len(draft.prefilled) == 1


@pytest.mark.parametrize("early", ["sync"], indirect=True)
def test_sync_mode_early_prefill_then_k0(early):
    draft, link, target = early
    _prefill(link, target, delay=0.05)
    prop, _ = _round(draft, link, target)
    assert draft.ks[0] == [0, 0, 0] and not bool(prop.hit.any()) and _answered(prop)
    assert len(draft.prefilled) == 1


@pytest.mark.parametrize("early", ["async"], indirect=True)
def test_middle_chunk_sends_nothing_and_a_failed_early_prefill_falls_back(early):
    draft, link, target = early
    for r in target.reqs:  # a chunked prefill's first chunk: the prompt is not complete yet
        r.extend_end = 1
    assert link.prefill_early(target.reqs, [0.0] * 3) == 0 and not draft.prefilled
    for r in target.reqs:
        del r.extend_end
    real = draft.server.engine.prefill

    def reject(msg):
        from sglang_ssd.draft.engine import EngineError

        raise EngineError("refused for the test", msg.rids)

    draft.server.engine.prefill = reject
    assert _prefill(link, target) == 3
    draft.server.engine.prefill = real
    prop, _ = _round(draft, link, target)  # the rows were forgotten: round 1 prefills them lazily
    assert _answered(prop) and draft.ks[0] == [-1, -1, -1] and link.client_ok


def test_finished_at_prefill_names_requests_the_prefill_ends():
    from types import SimpleNamespace as NS

    from sglang_ssd.sglang.early_prefill import finished_at_prefill

    def req(rid, max_new=16, stop=(), ignore_eos=False, chunk_end=None):
        r = NS(rid=rid, origin_input_ids=[1, 2, 3], output_ids=[],
               sampling_params=NS(max_new_tokens=max_new, stop_token_ids=set(stop), ignore_eos=ignore_eos))
        if chunk_end is not None:
            r.extend_end = chunk_end
        return r

    reqs = [req("one", max_new=1), req("eos"), req("eos-ignored", ignore_eos=True), req("stop", stop=[7]),
            req("goes-on"), req("middle-chunk", max_new=1, chunk_end=2)]
    assert finished_at_prefill(reqs, [5, 2, 2, 7, 5, 5], eos_ids=[2]) == ["one", "eos", "stop"]
