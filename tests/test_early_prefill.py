"""Draft prefill off the critical path (issue 14 item 5): the worker's real DraftLink sends the prompts
while the target prefills (Prefill.round0), the draft builds round 0's speculations for its top guesses
of the first token, and the first decode round reports k = 0 and can hit; a chunked prefill's middle
chunks send nothing; a failed early prefill falls back to the lazy prefill at round 1."""

from __future__ import annotations

import json
import time

import pytest

from sglang_ssd.config import SaguaroConfig
from sglang_ssd.draft.runner import DraftRunner
from sglang_ssd.sglang.draft_link import DraftLink
from tests.test_draft_link_late import DEADLINE, K, V, GreedyTarget, SlowDraft, _answered, _round
from tests.tiny_models import make_tiny_model


@pytest.fixture()
def early(request):
    model_dir = make_tiny_model(vocab_size=V, seed=1)
    draft = SlowDraft(model_dir)
    env = {"SGLANG_SSD_CONFIG": json.dumps({"spawn_draft": False, "draft_endpoint": draft.server.endpoint,
                                            "mode": request.param, "fan_out": 2, "round_deadline_s": DEADLINE,
                                            "draft_timeout_s": 30, "startup_timeout_s": 20})}
    link = DraftLink(SaguaroConfig.from_sources(model_dir, K, env=env), vocab_size=V, eos_ids=[])
    target = GreedyTarget(DraftRunner.from_dir(model_dir))
    yield draft, link, target
    link.client.close()
    draft.server.stop()


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
