"""Draft server and client over real ZMQ sockets: timeouts and late replies, handler exceptions, endpoints,
and the real thing (``python -m sglang_ssd.draft`` subprocess over ipc://) with malformed traffic."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid

import pytest
import zmq

from sglang_ssd.draft.client import DraftClient, DraftError, DraftTimeout
from sglang_ssd.draft.endpoint import normalize_endpoint, remove_ipc_file
from sglang_ssd.draft.server import SHUTDOWN_LINGER_MS, DraftServer
from sglang_ssd.protocol import PROTOCOL_VERSION, Health, HealthReply, Speculate, decode
from tests.draft_helpers import FAN, K, PROMPTS, REPO, V, check_q
from tests.draft_helpers import model_dir, runner  # noqa: F401  (fixtures)
from tests.tiny_models import greedy_reference, next_logits

# proposals are compared with the draft's own decode: the prompt lookup off (conftest.no_lookup)
pytestmark = pytest.mark.usefixtures("no_lookup")


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
    closed_with = []
    sock_close = server.sock.close
    server.sock.close = lambda linger=None: (closed_with.append(linger), sock_close(linger))[1]
    with DraftClient(server.endpoint, timeout_s=20) as client:
        assert client.health()["live_requests"] == 0
        client.shutdown()
    server._thread.join(10)
    # the Shutdown's Ack is the last reply: the socket must not drop it (linger 0 did, on a loaded machine)
    assert closed_with == [SHUTDOWN_LINGER_MS] and SHUTDOWN_LINGER_MS > 0


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


def _wait_for_build(client, builds: int, timeout_s: float = 60.0) -> None:
    """Block until the draft has finished `builds` cache builds.  Health is answered during a build
    without cutting it (any other message would cut it), so the next Speculate finds the whole cache:
    without this wait the hit count depends on whether this process or the draft is faster."""
    deadline = time.monotonic() + timeout_s
    while (h := client.health())["builds"] < builds:
        assert time.monotonic() < deadline, f"draft finished {h['builds']} of {builds} builds"
        time.sleep(0.005)
    assert h["builds_cut"] == 0, h


def _remote_rounds(runner, client, temps: dict[str, float], rounds: int, mode: str) -> int:
    """Drive rounds through the real socket; outcomes 'all K accepted + draft's top bonus' are cached
    (fan_out[K] >= 1), so in async mode every round after the first must hit -- once the build that
    follows each reply has finished (_wait_for_build)."""
    rids = list(PROMPTS)
    builds = client.health()["builds"]
    client.prefill(rids, [PROMPTS[r] for r in rids], [temps[r] for r in rids])
    ctx = {r: list(PROMPTS[r]) for r in rids}
    ks, bonuses = [-1] * 3, [3, 4, 5]
    hits = 0
    for rnd in range(rounds):
        for r, k, b in zip(rids, ks, bonuses):
            ctx[r] += (spec[r][:k] if k >= 0 else []) + [b]
        reply = client.speculate(rnd, rids, ks, bonuses, [temps[r] for r in rids])
        spec = {r: reply.tokens[i].tolist() for i, r in enumerate(rids)}
        if mode == "async":
            builds += 1
            _wait_for_build(client, builds)
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
