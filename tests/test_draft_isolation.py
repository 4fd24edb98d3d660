"""One draft process serves one target (issue 7): a second target connecting to the same endpoint is
refused while the first is active, requests from peers that are not the session owner are rejected,
the owner reconnecting under its stable client_id is accepted (its session resumes when its Hello is
the same), and an idle owner can be replaced."""

from __future__ import annotations

import uuid

import pytest

import sglang_ssd.draft.server as server_mod
from sglang_ssd.draft.client import DraftClient, DraftError
from sglang_ssd.draft.server import DraftServer
from tests.tiny_models import make_tiny_model

K, V, FAN = 3, 96, [2, 1, 1, 2]


@pytest.fixture()
def draft():
    server = DraftServer.from_model_dir(make_tiny_model(vocab_size=V, seed=1),
                                        f"ipc:///tmp/sglang-ssd-test-{uuid.uuid4().hex}.sock")
    server.start_in_thread()
    yield server
    server.stop()


def _client(server, cid=None) -> DraftClient:
    c = DraftClient(server.endpoint, timeout_s=20)
    if cid:
        c.client_id = cid
    return c


def test_second_target_is_refused_and_cannot_touch_the_session(draft):
    a, b = _client(draft, "target-a"), _client(draft, "target-b")
    try:
        a.hello(K, "async", FAN, V)
        a.prefill(["r1"], [[1, 2, 3, 4]], [0.0])
        first = a.speculate(1, ["r1"], [-1], [5], [0.0])
        with pytest.raises(DraftError, match="serves another target"):
            b.hello(K, "async", FAN, V)
        for call in (lambda: b.prefill(["r2"], [[1, 2]], [0.0]), lambda: b.release(["r1"]),
                     lambda: b.speculate(1, ["r1"], [0], [6], [0.0]), lambda: b.shutdown()):
            with pytest.raises(DraftError, match="not this draft's session owner"):
                call()
        assert b.health()["live_requests"] == 1  # observing is allowed; nothing changed
        # the owner is unaffected: its request is still there and keeps speculating
        nxt = a.speculate(2, ["r1"], [0], [int(first.tokens[0, 0]) + 1], [0.0])
        assert nxt.tokens.shape == (1, K)
        assert a.health()["refused_peers"] == 5
    finally:
        a.close()
        b.close()


def test_owner_reconnects_with_its_client_id_and_idle_owner_is_replaced(draft, monkeypatch):
    a = _client(draft, "target-a")
    a.hello(K, "async", FAN, V)
    a.prefill(["r1"], [[1, 2, 3, 4]], [0.0])
    a.close()
    a2 = _client(draft, "target-a")  # same worker, new socket (what DraftLink does on reconnect)
    b = _client(draft, "target-b")
    try:
        # accepted; the same Hello resumes the session: r1 is still there and speculates without a prefill
        assert a2.hello(K, "async", FAN, V).resumed
        assert a2.health()["live_requests"] == 1
        a2.speculate(1, ["r1"], [-1], [5], [0.0])
        # a different configuration (here: mode) starts a fresh session (the worker re-prefills)
        assert not a2.hello(K, "sync", FAN, V).resumed
        assert a2.health()["live_requests"] == 0
        a2.prefill(["r1"], [[1, 2, 3, 4]], [0.0])
        with pytest.raises(DraftError, match="serves another target"):
            b.hello(K, "async", FAN, V)
        monkeypatch.setattr(server_mod, "TAKEOVER_IDLE_S", 0.0)  # the owner has gone quiet
        assert not b.hello(K, "async", FAN, V).resumed
        assert b.health()["live_requests"] == 0
        with pytest.raises(DraftError, match="not this draft's session owner"):
            a2.speculate(1, ["r1"], [-1], [5], [0.0])
    finally:
        a2.close()
        b.close()
