"""Draft engine / server / client: SSD cache invariants against sequential references, error handling,
and the real thing (``python -m sglang_ssd.draft`` subprocess over ipc://)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest
import torch
import zmq

from sglang_ssd.draft.client import DraftClient, DraftError, DraftTimeout
from sglang_ssd.draft.endpoint import normalize_endpoint, remove_ipc_file
from sglang_ssd.draft.engine import DraftEngine, EngineError
from sglang_ssd.draft.runner import DraftRunner
from sglang_ssd.draft.server import DraftServer
from sglang_ssd.protocol import (PROTOCOL_VERSION, Health, HealthReply, Hello, Prefill, Release, Speculate,
                                 decode)
from sglang_ssd.saguaro.proposal import dequantize_proposal
from sglang_ssd.saguaro.saguaro_sampling import saguaro_probs
from tests.tiny_models import greedy_reference, make_reduced_head_model, make_tiny_model, next_logits

torch.set_num_threads(1)

K = 3
FAN = [2, 1, 1, 2]
FAN_MISS = [3, 1, 1, 1]
V = 96
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = {"r0": [5, 9, 17, 33, 2], "r1": [40, 41], "r2": [7, 8, 9, 10, 11, 12, 13, 14, 15]}


@pytest.fixture(scope="module")
def model_dir():
    return make_tiny_model(vocab_size=V, seed=1)


@pytest.fixture(scope="module")
def runner(model_dir):
    return DraftRunner.from_dir(model_dir)


class Target:
    """The verifier's side of the conversation: tracks each request's context and last speculation."""

    def __init__(self, engine: DraftEngine, temps: dict[str, float], cs: dict[str, float] | None = None):
        self.e, self.temps = engine, temps
        self.ctx = {r: list(p) for r, p in PROMPTS.items()}
        self.spec: dict[str, list[int]] = {}
        self.round = 0
        engine.prefill(Prefill(list(PROMPTS), list(PROMPTS.values()), [temps[r] for r in PROMPTS],
                               [(cs or {}).get(r, 1.0) for r in PROMPTS]))

    def step(self, outcomes: dict[str, tuple[int, int]]):
        rids = list(outcomes)
        msg = Speculate(self.round, rids, [outcomes[r][0] for r in rids], [outcomes[r][1] for r in rids],
                        [self.temps[r] for r in rids])
        self.round += 1
        for r in rids:
            k, b = outcomes[r]
            self.ctx[r] += (self.spec[r][:k] if k >= 0 else []) + [b]
        reply = decode([bytes(f) for f in self.e.speculate(msg).encode()])  # through the wire format
        for i, r in enumerate(rids):
            self.spec[r] = reply.tokens[i].tolist()
            assert self.e.requests[r].tokens == self.ctx[r]
        if self.e.session.mode == "async":
            self.e.build_cache()
        return rids, reply


KINDS = ["hit", "miss", "hit", "reset", "hit", "odd"]


def pick_outcome(rng: random.Random, e: DraftEngine, rid: str, spec: list[int],
                 kind: str = "") -> tuple[tuple[int, int], bool]:
    """A cached outcome (-> hit), a fresh miss, k = -1, or the odd 'bonus == rejected draft' miss."""
    keys = e.cache.keys(rid)
    kind = kind or rng.choice(KINDS)
    if kind == "hit" and keys:
        return rng.choice(keys), True
    if kind == "reset":
        return (-1, rng.randrange(V)), False
    k = rng.randint(0, K)
    if kind == "odd" and k < K:
        return (k, spec[k]), False          # never a real outcome; must still be handled exactly
    b = rng.choice([t for t in range(V) if (k, t) not in keys and (k == K or t != spec[k])])
    return (k, b), False


def check_cache_greedy(runner, e: DraftEngine, t: Target, rid: str) -> None:
    """Every cached (rid, j, b) holds the sequential greedy decode from C + s[:j] + [b], and the
    guesses at j are the top-fan_out[j] draft tokens there, s_{j+1} excluded."""
    ctx, spec, keys = t.ctx[rid], t.spec[rid], e.cache.keys(rid)
    fan = FAN if e.requests[rid].last_hit else FAN_MISS
    for j in range(K + 1):
        z = next_logits(runner, ctx + spec[:j])
        if j < K:
            z[spec[j]] = -float("inf")
        want = set(torch.topk(z, fan[j]).indices.tolist())
        assert {b for jj, b in keys if jj == j} == want, (rid, j)
    for j, b in keys:
        entry = e.cache.peek(rid, j, b)
        assert entry.q16 is None
        assert entry.tokens.tolist() == greedy_reference(runner, ctx + spec[:j] + [b], K), (rid, j, b)


def check_q(runner, ctx: list[int], toks: list[int], q16, temp: float, fs=None, c: float = 1.0) -> None:
    """q row t == softmax(z_t / T) of a sequential recomputation (fp16 rounding), token drawn from it;
    with Saguaro sampling, sigma_{F_t, C} of it (F_t = fs[t])."""
    q = dequantize_proposal(torch.as_tensor(np.asarray(q16)))
    for i, tok in enumerate(toks):
        ref = torch.softmax(next_logits(runner, ctx + toks[:i]) / temp, -1)
        if fs is not None:
            ref = saguaro_probs(ref[None], fs[i], c)[0]
        torch.testing.assert_close(q[i], ref, atol=1e-5, rtol=2e-3)  # fp16: 2^-11 relative
        assert q[i, tok] > 0


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
# ---------------------------------------------------------------------------------------------
def test_client_timeout_then_late_reply_is_discarded():
    ep = f"ipc:///tmp/sglang-ssd-test-{uuid.uuid4().hex}.sock"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(ep)
    stop = threading.Event()

    def serve():
        n = 0
        while not stop.is_set():
            if not router.poll(50):
                continue
            ident, *frames = router.recv_multipart()
            msg = decode(frames)
            n += 1
            if n == 1:
                time.sleep(0.4)  # too late for the first call
            router.send_multipart([ident, *HealthReply(stats={"n": n}, req_id=msg.req_id).encode()])

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    client = DraftClient(ep, timeout_s=0.15, context=ctx)
    try:
        with pytest.raises(DraftTimeout):
            client.health()
        assert client.health(timeout_s=3.0) == {"n": 2}   # the late reply to call 1 was dropped
        assert client.discarded == 1
    finally:
        stop.set()
        th.join()
        client.close()
        router.close(0)
        ctx.term()
        remove_ipc_file(ep)


def test_in_thread_server_survives_handler_exceptions(model_dir, monkeypatch):
    server = DraftServer.from_model_dir(model_dir, f"ipc:///tmp/sglang-ssd-test-{uuid.uuid4().hex}.sock")
    server.start_in_thread()
    client = DraftClient(server.endpoint, timeout_s=20)
    try:
        client.hello(K, "async", FAN, V)
        client.prefill(["x"], [[1, 2, 3]], [0.0])

        def boom(msg):
            raise RuntimeError("kaboom")

        monkeypatch.setattr(server.engine, "speculate", boom)
        with pytest.raises(DraftError, match="kaboom") as ei:
            client.speculate(0, ["x"], [-1], [4], [0.0])
        assert ei.value.rids == ["x"]
        monkeypatch.undo()
        assert client.health()["handler_errors"] == 1
        with pytest.raises(DraftError, match="unknown rid"):  # the failed row was dropped
            client.speculate(1, ["x"], [-1], [4], [0.0])
        client.prefill(["x"], [[1, 2, 3]], [0.0])
        assert client.speculate(2, ["x"], [-1], [4], [0.0]).tokens.shape == (1, K)
        client.shutdown()
        server._thread.join(10)
        assert not server._thread.is_alive()
    finally:
        client.close()
        server.stop()


def test_endpoints_default_to_private_ipc_and_loopback_tcp(model_dir):
    a, b = normalize_endpoint(None), normalize_endpoint("ipc")
    assert a.startswith("ipc:///tmp/sglang-ssd-") and a.endswith(".sock") and a != b
    assert normalize_endpoint("tcp") == "tcp://127.0.0.1:*"
    assert normalize_endpoint("tcp:5555") == normalize_endpoint("tcp://:5555") == "tcp://127.0.0.1:5555"
    assert normalize_endpoint("tcp://10.0.0.1:7", curve=True) == "tcp://10.0.0.1:7"
    with pytest.raises(ValueError, match="curve"):  # not loopback: CurveZMQ only (tests/test_curve.py)
        normalize_endpoint("tcp://10.0.0.1:7")
    with pytest.raises(ValueError):
        normalize_endpoint("udp://x")
    server = DraftServer.from_model_dir(model_dir, "tcp")
    assert server.endpoint.startswith("tcp://127.0.0.1:")
    server.start_in_thread()
    with DraftClient(server.endpoint, timeout_s=20) as client:
        assert client.health()["live_requests"] == 0
        client.shutdown()
    server._thread.join(10)


# ---------------------------------------------------------------------------------------------
# the real thing: python -m sglang_ssd.draft in its own process
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def draft_proc(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("draft") / "draft.log"
    ep = f"ipc:///tmp/sglang-ssd-test-{uuid.uuid4().hex}.sock"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "sglang_ssd.draft", "--model", model_dir, "--bind", ep,
                                 "--device", "cpu", "--threads", "1", "--cpu-core", str(max(os.sched_getaffinity(0))),
                                 "--log-level", "INFO"], cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT)
    client = DraftClient(ep, timeout_s=60)
    yield proc, client, ep, log
    client.close()
    if proc.poll() is None:
        proc.terminate()
        proc.wait(10)


def _remote_rounds(runner, client, temps: dict[str, float], rounds: int, mode: str) -> int:
    """Drive rounds through the real socket; outcomes 'all K accepted + draft's top bonus' are cached
    (fan_out[K] >= 1), so in async mode every round after the first must hit."""
    rids = list(PROMPTS)
    client.prefill(rids, [PROMPTS[r] for r in rids], [temps[r] for r in rids])
    ctx = {r: list(PROMPTS[r]) for r in rids}
    ks, bonuses = [-1] * 3, [3, 4, 5]
    hits = 0
    for rnd in range(rounds):
        for r, k, b in zip(rids, ks, bonuses):
            ctx[r] += (spec[r][:k] if k >= 0 else []) + [b]
        reply = client.speculate(rnd, rids, ks, bonuses, [temps[r] for r in rids])
        spec = {r: reply.tokens[i].tolist() for i, r in enumerate(rids)}
        if mode == "async" and rnd > 0:
            assert reply.hit.all(), rnd
        if mode == "sync":
            assert not reply.hit.any()
        hits += int(reply.hit.sum())
        for i, r in enumerate(rids):
            if temps[r] == 0:
                assert spec[r] == greedy_reference(runner, ctx[r], K), (rnd, r)
            else:
                check_q(runner, ctx[r], spec[r], reply.q_for_row(i, V), temps[r])
        # next outcome: alternate "all accepted" (bonus = top-1 after s_K) and "reject at j = 0"
        # (bonus = best token other than s_1) -- both among the cached guesses
        ks, bonuses = [], []
        for r in rids:
            j = K if rnd % 2 == 0 else 0
            z = next_logits(runner, ctx[r] + spec[r][:j])
            if j < K:
                z[spec[r][j]] = -float("inf")
            ks.append(j)
            bonuses.append(int(z.argmax()))
        assert reply.answer_ms >= 0 and reply.build_ms >= 0
    client.release(rids)
    return hits


def test_subprocess_draft_end_to_end(runner, draft_proc):
    proc, client, ep, log = draft_proc
    hello = client.hello(K, "async", FAN, V, eos_ids=[1], timeout_s=120)
    assert hello.draft_vocab_size == V and hello.pid == proc.pid
    with pytest.raises(DraftError, match="vocab"):
        client.hello(K, "async", FAN, V + 5)
    client.hello(K, "async", FAN, V)
    assert _remote_rounds(runner, client, {"r0": 0.0, "r1": 0.0, "r2": 0.0}, 5, "async") == 12
    assert _remote_rounds(runner, client, {"r0": 1.0, "r1": 0.0, "r2": 0.7}, 4, "async") == 9
    stats = client.health()
    assert stats["live_requests"] == 0 and stats["hits"] == 21 and stats["builds"] == 9
    assert stats["avg_build_ms"] > 0 and stats["kv_tokens"] == 0
    assert stats["sglang_imported"] == 0      # the draft process never imports SGLang
    client.hello(K, "sync", FAN, V)           # reconfigure: plain SD
    assert _remote_rounds(runner, client, {"r0": 0.0, "r1": 1.0, "r2": 0.0}, 3, "sync") == 0
    with pytest.raises(DraftError, match="unknown rid"):
        client.speculate(99, ["nope"], [-1], [1], [0.0])

    # malformed traffic from a raw DEALER: logged, answered when possible, server stays up
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(ep)
    try:
        raw.send_multipart([b"\x00garbage"])
        good = [bytes(f) for f in Health(req_id=4242).encode()]
        import msgpack
        h = msgpack.unpackb(good[0])
        h["version"] = PROTOCOL_VERSION + 1
        raw.send_multipart([msgpack.packb(h)])
        spec = [bytes(f) for f in Speculate(1, ["a"], [0], [1], [0.0], req_id=77).encode()]
        raw.send_multipart([spec[0], spec[1][:3], spec[2], spec[3]])    # truncated array
        replies = []
        for _ in range(3):
            assert raw.poll(20000)
            replies.append(decode(raw.recv_multipart()))
        assert all(r.TYPE == "error" for r in replies)
        assert "version" in replies[1].message and replies[1].req_id == 4242
        assert replies[2].req_id == 77
    finally:
        raw.close(0)
    stats = client.health()
    assert stats["protocol_errors"] == 3
    client.shutdown()
    assert proc.wait(20) == 0
    text = log.read_text()
    assert "READY" in text and text.count("rejected malformed message") == 3
    assert not os.path.exists(ep[len("ipc://"):])


def test_draft_side_never_imports_sglang():
    """Static guard: the draft process (sglang_ssd/draft, sglang_ssd/protocol/) must not import SGLang."""
    import ast
    import glob

    pkg = os.path.join(REPO, "sglang_ssd")
    files = glob.glob(os.path.join(pkg, "draft", "*.py")) + glob.glob(os.path.join(pkg, "protocol", "*.py"))
    assert len(files) > 20 and any(f.endswith("messages.py") for f in files)
    for path in files:
        with open(path) as fh:
            tree = ast.parse(fh.read())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert name.split(".")[0] != "sglang", f"{path} imports {name}"
                assert not name.startswith("sglang_ssd.sglang"), f"{path} imports {name}"


def test_client_fails_at_once_when_the_draft_is_gone(tmp_path):
    """With a liveness probe, a call to a dead draft fails within a poll slice, not at the timeout."""
    import time as _time

    from sglang_ssd.draft.client import ALIVE_POLL_MS, DraftClient, DraftError

    endpoint = f"ipc://{tmp_path}/nobody.sock"
    with DraftClient(endpoint, timeout_s=30, alive=lambda: False) as client:
        t0 = _time.monotonic()
        with pytest.raises(DraftError, match="is gone"):
            client.health()
        assert _time.monotonic() - t0 < 5 * ALIVE_POLL_MS / 1000
    with DraftClient(endpoint, timeout_s=0.3, alive=lambda: True) as client:  # alive but silent: timeout
        from sglang_ssd.draft.client import DraftTimeout

        with pytest.raises(DraftTimeout):
            client.health()


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
