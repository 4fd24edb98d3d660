"""The worker's DraftLink against a confused draft (issue 7): replies with the wrong round, the wrong number
of rows, token ids outside the vocabulary, q of the wrong shape, or an error, and a draft that never
answers. Each is rejected, logged and counted; the round falls back to target-only decoding (nothing
the draft sent is used).  A broken link reconnects on a later round; a draft that merely misses the
deadline keeps its session: no reconnect, and while its reply is outstanding rounds ask it nothing."""

from __future__ import annotations

import json
import threading
import time
import uuid
from types import SimpleNamespace

import numpy as np
import pytest
import zmq

from sglang_ssd.config import SaguaroConfig
from sglang_ssd.draft.endpoint import remove_ipc_file
from sglang_ssd.protocol import (PROTOCOL_VERSION, Ack, ErrorReply, Hello, HelloReply, Prefill, Release,
                                 SpecReply, Speculate, decode)
from tests.tiny_models import make_tiny_model

K, V = 3, 96


class FakeDraft:
    """A ROUTER that speaks the protocol correctly except for Speculate, answered by `bad(msg)`."""

    def __init__(self, bad):
        self.endpoint = f"ipc:///tmp/sglang-ssd-test-{uuid.uuid4().hex}.sock"
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(self.endpoint)
        self.bad, self.hellos, self.stop = bad, 0, threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        while not self.stop.is_set():
            if not self.sock.poll(20):
                continue
            ident, *frames = self.sock.recv_multipart()
            msg = decode(frames)
            if isinstance(msg, Hello):
                self.hellos += 1
                reply = HelloReply(PROTOCOL_VERSION, V, "fake", 1)
            elif isinstance(msg, (Prefill, Release)):
                reply = Ack(count=len(msg.rids))
            elif isinstance(msg, Speculate):
                reply = self.bad(msg)
                if reply is None:
                    continue  # never answer
            else:
                reply = Ack()
            reply.req_id = msg.req_id
            self.sock.send_multipart([ident, *reply.encode()])

    def close(self):
        self.stop.set()
        self.thread.join()
        self.sock.close(0)
        self.ctx.term()
        remove_ipc_file(self.endpoint)


def _reply(msg, n=None, k=K, round_id=None, token=1, q_rows=(), q_shape=None, rows=None):
    n = len(msg.rids) if n is None else n
    q = np.zeros(q_shape if q_shape is not None else (len(q_rows), k, V), dtype=np.float16)
    tokens = np.full((n, k), token, dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64)
    return SpecReply(round_id=msg.round_id if round_id is None else round_id,
                     tokens=tokens, hit=np.zeros(n, dtype=np.bool_),
                     q_rows=np.asarray(q_rows, dtype=np.int64), q=q)


CASES = {
    "wrong round": lambda m: _reply(m, round_id=m.round_id + 7),
    "missing rows": lambda m: _reply(m, n=len(m.rids) - 1),
    "token id outside the vocabulary": lambda m: _reply(m, token=V + 5),
    "-1 padding before a valid token": lambda m: _reply(m, rows=[[1, -1, 2], [1, 1, 1]]),
    "negative token id other than -1": lambda m: _reply(m, rows=[[1, 1, 1], [1, -2, -2]]),
    "padding then an id >= vocab": lambda m: _reply(m, rows=[[1, -1, V], [1, 1, 1]]),
    "q of the wrong vocabulary": lambda m: _reply(m, q_rows=[0], q_shape=(1, K, V - 1)),
    "error reply": lambda m: ErrorReply(message="confused", rids=list(m.rids)),
    "no answer": lambda m: None,
}


@pytest.mark.parametrize("case", list(CASES))
def test_confused_draft_rounds_fall_back_and_are_counted(case):
    model_dir = make_tiny_model(vocab_size=V, seed=1)
    fake = FakeDraft(CASES[case])
    from sglang_ssd.sglang.draft_link import DraftLink

    env = {"SGLANG_SSD_CONFIG": json.dumps({"spawn_draft": False, "draft_endpoint": fake.endpoint, "fan_out": 1,
                                            "round_deadline_s": 0.3, "startup_timeout_s": 10})}
    link = DraftLink(SaguaroConfig.from_sources(model_dir, K, env=env), vocab_size=V, eos_ids=[])
    reqs = [SimpleNamespace(rid=f"r{i}", origin_input_ids=[1, 2, 3], output_ids=[4], sampling_params=None)
            for i in range(2)]
    try:
        t0 = time.monotonic()
        prop = link.speculate(reqs, [0.0, 1.0])
        assert time.monotonic() - t0 < 5.0  # bounded even when the draft never answers
        # nothing from the bad reply is used: a target-only round (no drafts may be accepted)
        assert prop.max_accept.tolist() == [0, 0] and not prop.q_valid.any() and not prop.hit.any()
        assert link.stats.fallback_rows == 2
        if case == "no answer":  # a live draft that is late: nothing is reset, k = 0 is recorded
            assert link.stats.errors == 0 and link.stats.deadline_misses == 1 and link.client_ok
            assert {r: (s.spec, s.known_len) for r, s in link.states.items()} == {"r0": (None, 4), "r1": (None, 4)}
            for r in reqs:
                r.output_ids.append(5)  # what the target-only round committed
            for rnd in range(2):  # one bounded wait for the late reply, then rounds do not wait at all
                t0 = time.monotonic()
                prop = link.speculate(reqs, [0.0, 1.0])
                assert time.monotonic() - t0 < (0.3 if rnd == 0 else 0.0) + 0.25
                assert prop.max_accept.tolist() == [0, 0]
            assert fake.hellos == 1 and link.stats.reconnects == 0 and link.stats.stalled_rounds == 2
            assert link.as_dict()["deadline_misses"] == 1 and link.as_dict()["late_replies_discarded"] == 0
            return
        assert link.stats.errors == 1 and link.stats.deadline_misses == 0
        # a broken link: it will reconnect; these rows are out of sync and get re-prefilled
        assert not link.client_ok and all(s.known_len < 0 for s in link.states.values())
        link._next_retry = 0.0
        link.speculate(reqs, [0.0, 1.0])  # next round: a fresh Hello (then the same bad answer)
        assert fake.hellos == 2 and link.stats.reconnects == 1 and link.stats.resets == 1
    finally:
        link.cfg.spawn_draft = False
        link.client.close()
        fake.close()


def test_usable_drafts_accepts_only_trailing_padding():
    import torch

    from sglang_ssd.sglang.link_state import usable_drafts

    toks, cap = usable_drafts(torch.tensor([[4, 5, 6], [4, -1, -1], [-1, -1, -1], [V - 1, 0, -1]]), V)
    assert toks.tolist() == [[4, 5, 6], [4, 0, 0], [0, 0, 0], [V - 1, 0, 0]] and cap.tolist() == [3, 1, 0, 2]
    for bad in ([[4, -1, 5]], [[-1, 5, 5]], [[4, V, -1]], [[4, -3, -1]], [[4, 5, V]]):
        with pytest.raises(ValueError):
            usable_drafts(torch.tensor(bad), V)


def test_short_speculations_cap_max_accept_and_the_outcome_check():
    """A reply row with -1 padding (a cut draft build) is a d-token speculation: max_accept = d, the
    padding becomes a valid id for the verify input, q rows pass through, and next round's outcome is
    checked against the d usable tokens only."""
    seen = []

    def short(m):
        seen.append(m)
        if len(seen) > 1:
            return _reply(m)
        r = _reply(m, rows=[[5, -1, -1], [7, 8, -1]], q_rows=[1])
        r.q[0, 0, 7] = r.q[0, 1, 8] = 1.0  # row 1's q; its padded position stays zero
        return r

    model_dir = make_tiny_model(vocab_size=V, seed=1)
    fake = FakeDraft(short)
    from sglang_ssd.sglang.draft_link import DraftLink

    env = {"SGLANG_SSD_CONFIG": json.dumps({"spawn_draft": False, "draft_endpoint": fake.endpoint, "fan_out": 1,
                                            "round_deadline_s": 5.0, "startup_timeout_s": 10})}
    link = DraftLink(SaguaroConfig.from_sources(model_dir, K, env=env), vocab_size=V, eos_ids=[])
    reqs = [SimpleNamespace(rid=f"r{i}", origin_input_ids=[1, 2, 3], output_ids=[4], sampling_params=None)
            for i in range(2)]
    try:
        prop = link.speculate(reqs, [0.0, 1.0])
        assert link.stats.errors == 0 and link.client_ok
        assert prop.tokens.tolist() == [[5, 0, 0], [7, 8, 0]] and prop.max_accept.tolist() == [1, 2]
        assert prop.q_valid.tolist() == [False, True] and float(prop.q16[1, 0, 7]) == 1.0
        assert not prop.q16[1, 2].any()
        assert link.states["r0"].spec == [5] and link.states["r1"].spec == [7, 8]
        # r0 accepted its 1 usable draft (+ bonus); r1 claims 3 accepted: more than its 2 usable -> out of sync
        reqs[0].output_ids = [4, 5, 9]
        reqs[1].output_ids = [4, 7, 8, 0, 9]
        link.speculate(reqs, [0.0, 1.0])
        assert seen[1].ks == [1, -1] and link.stats.errors == 0
    finally:
        link.cfg.spawn_draft = False
        link.client.close()
        fake.close()


def test_send_with_no_connected_draft_is_bounded():
    """A DEALER with no pipe to queue on blocks a send (libzmq ended the session after a refused CurveZMQ
    handshake, or the high-water mark is full; here: IMMEDIATE with no peer): the client waits at most the
    call's timeout, then DraftUnsent, a DraftError, which the link treats as broken (reconnect), never a
    wait for a reply that cannot come."""
    from sglang_ssd.draft.client import DraftClient, DraftError, DraftUnsent

    endpoint = f"ipc:///tmp/sglang-ssd-test-{uuid.uuid4().hex}.sock"  # nothing binds it
    client = DraftClient(endpoint, timeout_s=0.3)
    client.sock.close(0)  # a socket that queues nothing until a peer has connected: sends would block
    client.sock = client.ctx.socket(zmq.DEALER)
    client.sock.setsockopt(zmq.IMMEDIATE, 1)
    client.sock.setsockopt(zmq.LINGER, 0)
    client.sock.connect(endpoint)
    try:
        t0 = time.monotonic()
        with pytest.raises(DraftUnsent, match="no connected draft"):
            client.health()
        assert time.monotonic() - t0 < 2.0
        assert issubclass(DraftUnsent, DraftError) and not issubclass(DraftUnsent, TimeoutError)
        client.alive = lambda: False  # a watched draft process that is gone fails the send at once
        with pytest.raises(DraftError, match="is gone"):
            client.health(timeout_s=30)
        assert time.monotonic() - t0 < 5.0
    finally:
        client.close()
