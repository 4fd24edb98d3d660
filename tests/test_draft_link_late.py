"""A late or stalled draft resets nothing (issue 14): the worker's real DraftLink against a real draft
server (in a thread) whose engine is slowed once.  A round that misses its deadline decodes target-only
and is recorded as the outcome k = 0 of the proposal the draft will have made; the late reply is
discarded, the next round tells the draft k = 0 (no re-prefill, no new session) and speculation goes on.
A draft stalled for longer costs one deadline and one bounded wait, then rounds do not wait at all; once
it answers, only the rows that fell out of step are re-prefilled, in the same session."""

from __future__ import annotations

import json
import logging
import time
import uuid
from types import SimpleNamespace

import pytest
import torch

from sglang_ssd.config import SaguaroConfig
from sglang_ssd.draft.runner import DraftRunner
from sglang_ssd.draft.server import DraftServer
from sglang_ssd.sglang.draft_link import DraftLink
from tests.tiny_models import greedy_reference, make_tiny_model

# proposals are compared with the draft's own decode: the prompt lookup off (conftest.no_lookup)
pytestmark = pytest.mark.usefixtures("no_lookup")

torch.set_num_threads(1)

K, V, DEADLINE = 3, 96, 0.5
PROMPTS = {"a": [5, 9, 17, 33, 2], "b": [40, 41], "c": [7, 8, 9, 10, 11, 12]}
N_OUT = 150


class SlowDraft:
    """A real draft server whose next Speculate (once armed) sleeps ``delay`` s before answering."""

    def __init__(self, model_dir):
        self.server = DraftServer.from_model_dir(model_dir, f"ipc:///tmp/sglang-ssd-test-{uuid.uuid4().hex}.sock")
        e = self.server.engine
        self.delay, self.ks, self.prefilled = 0.0, [], []
        real_spec, real_prefill = e.speculate, e.prefill

        def speculate(msg):
            delay, self.delay = self.delay, 0.0
            time.sleep(delay)
            self.ks.append(list(msg.ks))
            return real_spec(msg)

        def prefill(msg):
            self.prefilled.append(list(msg.rids))
            return real_prefill(msg)

        e.speculate, e.prefill = speculate, prefill
        self.server.start_in_thread()


class GreedyTarget:
    """The verifier: the target is the draft's own model, greedy, so its output is known in advance
    (``ref``) and every round commits the accepted drafts plus one bonus token, exactly."""

    def __init__(self, runner):
        self.ref = {r: greedy_reference(runner, p, N_OUT) for r, p in PROMPTS.items()}
        self.reqs = [SimpleNamespace(rid=r, origin_input_ids=list(p), output_ids=[self.ref[r][0]],
                                     sampling_params=None) for r, p in PROMPTS.items()]

    def verify(self, prop) -> list[int]:
        accepted = []
        for i, r in enumerate(self.reqs):
            ref, n, a = self.ref[r.rid], len(r.output_ids), 0
            while a < int(prop.max_accept[i]) and int(prop.tokens[i, a]) == ref[n + a]:
                a += 1
            r.output_ids = ref[: n + a + 1]
            accepted.append(a)
        return accepted


@pytest.fixture()
def setup(caplog):
    caplog.set_level(logging.INFO)
    yield from link_setup("async")


def link_setup(mode: str):
    """A real draft server (slowable) on the tiny model, the worker's DraftLink to it, a greedy target."""
    model_dir = make_tiny_model(vocab_size=V, seed=1)
    draft = SlowDraft(model_dir)
    env = {"SGLANG_SSD_CONFIG": json.dumps({"spawn_draft": False, "draft_endpoint": draft.server.endpoint,
                                            "mode": mode, "fan_out": 2, "round_deadline_s": DEADLINE,
                                            "draft_timeout_s": 30, "startup_timeout_s": 20})}
    link = DraftLink(SaguaroConfig.from_sources(model_dir, K, env=env), vocab_size=V, eos_ids=[])
    target = GreedyTarget(DraftRunner.from_dir(model_dir))
    yield draft, link, target
    link.client.close()
    draft.server.stop()


def _answered(prop) -> bool:
    """The draft answered every row: K drafts, or 1..K-1 when its cache build was cut short."""
    return all(1 <= m <= K for m in prop.max_accept.tolist())


def _round(draft, link, target):
    """One decode round; checks the draft's context equals what SGLang committed whenever it spoke."""
    t0 = time.monotonic()
    prop = link.speculate(target.reqs, [0.0] * len(target.reqs))
    took = time.monotonic() - t0
    if int(prop.max_accept.max()) > 0:
        for r in target.reqs:
            assert draft.server.engine.requests[r.rid].tokens == r.origin_input_ids + r.output_ids
    accepted = target.verify(prop)
    link.record([a + 1 for a in accepted])
    time.sleep(0.03)  # the target's own forward: the draft's cache build runs meanwhile (else it is cut)
    return prop, took


def test_late_round_keeps_the_session_then_a_stall_costs_only_bounded_rounds(setup, caplog):
    draft, link, target = setup
    rids = [r.rid for r in target.reqs]
    for _ in range(3):
        prop, took = _round(draft, link, target)
        assert _answered(prop) and took < DEADLINE
    assert draft.prefilled == [rids]

    # (1) one late round: target-only, nothing reset; the next round says k = 0 and speculates again
    draft.delay = 0.8
    prop, took = _round(draft, link, target)
    assert prop.max_accept.tolist() == [0] * 3 and DEADLINE - 0.05 < took < DEADLINE + 0.3
    assert link.stats.deadline_misses == 1 and link.client_ok
    prop, took = _round(draft, link, target)  # waits (bounded) for the late reply, then speculates
    assert _answered(prop) and took < 2 * DEADLINE
    assert draft.ks[-1] == [0, 0, 0]  # the late round's outcome, as the draft saw its own proposal
    assert draft.prefilled == [rids]  # no re-prefill
    hits = 0
    for _ in range(6):
        prop, took = _round(draft, link, target)
        assert _answered(prop)
        hits += int(prop.hit.sum())
    assert hits > 0

    # (2) a stall: one deadline, one bounded wait, then rounds do not wait; it answers and catches up
    draft.delay = 3.0
    t_stall = time.monotonic()
    times = []
    while True:
        prop, took = _round(draft, link, target)
        if _answered(prop):  # it answered: rows out of step were re-prefilled
            break
        assert prop.max_accept.tolist() == [0] * 3 and time.monotonic() - t_stall < 15
        times.append(took)
        time.sleep(0.05)  # the target's own forward
    assert len(times) >= 5 and took < DEADLINE
    assert times[0] < DEADLINE + 0.3 and times[1] < DEADLINE + 0.3 and max(times[2:]) < 0.1, times
    assert link.stats.stalled_rounds == len(times) - 1
    assert draft.prefilled[-1] == rids and len(draft.prefilled) == 2
    hits = 0
    for _ in range(4):
        prop, took = _round(draft, link, target)
        assert _answered(prop)
        hits += int(prop.hit.sum())
    assert hits > 0
    s = link.as_dict()
    assert s["deadline_misses"] == 2 and s["late_replies_discarded"] == 2
    assert s["reconnects"] == 0 and s["resets"] == 0 and s["errors"] == 0
    assert "new session" not in caplog.text and set(draft.server.engine.requests) == set(rids)
    link.release(rids)
    assert not draft.server.engine.requests


def test_late_release_and_a_broken_link_that_resumes_the_session(setup, caplog):
    draft, link, target = setup
    rids = [r.rid for r in target.reqs]
    for _ in range(2):
        _round(draft, link, target)
    # a Release whose Ack is late: the entry stays until the Ack is in, nothing is reset
    e, real_release = draft.server.engine, draft.server.engine.release

    def slow_release(msg):
        time.sleep(0.8)
        return real_release(msg)

    e.release = slow_release
    t0 = time.monotonic()
    link.release(["c"])
    assert DEADLINE - 0.05 < time.monotonic() - t0 < DEADLINE + 0.3
    assert link.stats.deadline_misses == 1 and link.states["c"].known_len < 0
    e.release = real_release
    target.reqs = target.reqs[:2]
    prop, took = _round(draft, link, target)  # waits for the Ack (bounded), then speculates a and b
    assert _answered(prop) and took < 2 * DEADLINE
    assert set(link.states) == {"a", "b"} and set(e.requests) == {"a", "b"} and draft.prefilled == [rids]

    # an error reply breaks the link: the link reconnects, and its unchanged Hello resumes the session
    real_spec = e.speculate

    def failing(msg):
        e.speculate = real_spec
        raise RuntimeError("boom")  # the server answers "internal error" and drops these rows

    e.speculate = failing
    prop, _ = _round(draft, link, target)
    assert prop.max_accept.tolist() == [0, 0] and not link.client_ok and link.stats.errors == 1
    link._next_retry = 0.0
    for _ in range(3):
        prop, took = _round(draft, link, target)
        assert _answered(prop) and took < DEADLINE
    s = link.as_dict()
    assert s["reconnects"] == 1 and s["resumes"] == 1 and s["resets"] == 0
    assert draft.prefilled[-1] == ["a", "b"]  # the rows of the failed call, re-prefilled in the same session
    assert "new session" not in caplog.text and "session resumed" in caplog.text
