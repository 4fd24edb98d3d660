"""Wire format: round trips, strict validation, and fuzzing (only ProtocolError may escape decode)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_ssd import protocol as P
from sglang_ssd.protocol import framing
from sglang_ssd.protocol import (PROTOCOL_VERSION, Ack, ErrorReply, Health, HealthReply, Hello, HelloReply, Prefill,
                                 ProtocolError, Release, Shutdown, Speculate, SpecReply, decode, peek_req_id)


def _reply(n=3, k=4, v=11, q_rows=(0, 2)):
    rng = np.random.default_rng(0)
    return SpecReply(round_id=7, tokens=rng.integers(0, v, (n, k)), hit=np.array([True, False, True][:n]),
                     q_rows=np.array(q_rows, dtype=np.int64),
                     q=rng.random((len(q_rows), k, v)).astype(np.float16), answer_ms=1.5, backup_ms=0.25,
                     build_ms=3.0, glue_ms=1.0, tree_ms=2.0, req_id=99)


MESSAGES = [
    Hello(1, "client-x", 3, "async", [3, 2, 1, 2], 32000, [2, 7], req_id=1),
    Hello(1, "c", 1, "sync", [1, 0], 10, [], fan_out_miss=[2, 0], req_id=2),
    HelloReply(version=1, draft_vocab_size=32000, draft_model_name="tiny", pid=123, device="cpu",
               dtype="float32", max_batch=64, req_id=3),
    HelloReply(version=3, draft_vocab_size=96, draft_model_name="tiny", pid=7, resumed=True, req_id=14),
    Prefill(["a", "b"], [[1, 2, 3], [4]], [0.0, 0.7], req_id=4),
    Prefill([], [], [], req_id=5),
    Speculate(11, ["a", "b", "c"], [-1, 0, 4], [5, 6, 7], [0.0, 1.0, 0.5], req_id=6),
    Release(["a", "zz"], req_id=8),
    Health(req_id=9),
    HealthReply(stats={"rounds": 3, "hit_rate": 0.5}, req_id=10),
    Shutdown(req_id=11),
    Ack(count=2, message="ok", req_id=12),
    ErrorReply("unknown rid", ["x"], req_id=13),
]


def _eq(a, b):
    assert type(a) is type(b)
    for name in a.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y)
        else:
            assert x == y, name


@pytest.mark.parametrize("msg", MESSAGES + [_reply(), _reply(q_rows=())], ids=lambda m: m.TYPE)
def test_round_trip(msg):
    frames = msg.encode()
    back = decode([bytes(f) for f in frames])
    _eq(msg, back)
    assert type(msg).decode([bytes(f) for f in frames]).req_id == msg.req_id
    assert peek_req_id(frames) == msg.req_id


def test_spec_reply_arrays_and_q_lookup():
    r = decode([bytes(f) for f in _reply().encode()])
    assert r.tokens.dtype == np.int64 and r.q.dtype == np.float16 and r.hit.dtype == np.bool_
    assert r.tokens.flags.writeable and r.q.flags.writeable
    assert np.array_equal(r.q_for_row(2), r.q[1]) and r.q_for_row(1) is None
    frames = _reply().encode()
    assert len(frames) == 6 and len(frames[4]) == 2 * 4 * 11 * 2 and len(frames[5]) == 0  # dense: no q_ids


def test_spec_reply_sparse_q_over_head_ids():
    """q over a reduced head's ids: the ids travel once, values per row; q_dense / q_for_row scatter to V."""
    rng = np.random.default_rng(1)
    ids = np.array([0, 3, 4, 9], dtype=np.int64)
    q = rng.random((2, 4, 4)).astype(np.float16)
    r = decode([bytes(f) for f in SpecReply(round_id=1, tokens=np.zeros((3, 4)), hit=np.zeros(3, bool),
                                            q_rows=np.array([0, 2]), q=q, q_ids=ids).encode()])
    assert np.array_equal(r.q_ids, ids) and r.q.shape == (2, 4, 4)
    dense = r.q_dense(11)
    assert dense.shape == (2, 4, 11) and np.array_equal(dense[:, :, ids], q)
    assert not np.delete(dense, ids, axis=2).any()
    assert np.array_equal(r.q_for_row(2, 11), dense[1]) and r.q_for_row(1, 11) is None
    with pytest.raises(ValueError, match="vocab_size"):
        r.q_for_row(0)
    with pytest.raises(ProtocolError, match="vocab size"):
        r.q_dense(9)                                      # id 9 is outside a 9-token vocabulary
    for bad, match in ((np.array([0, 4, 3, 9]), "q_ids"), (np.array([-1, 3, 4, 9]), "q_ids"),
                       (np.array([0, 3, 4]), "width")):
        with pytest.raises(ProtocolError, match=match):
            SpecReply(round_id=1, tokens=np.zeros((3, 4)), hit=np.zeros(3, bool), q_rows=np.array([0, 2]), q=q,
                      q_ids=bad).encode()


def test_wrong_class_decode():
    with pytest.raises(ProtocolError, match="expected"):
        Hello.decode([bytes(f) for f in Health().encode()])


def _header(frames):
    return msgpack.unpackb(frames[0], raw=False)


def _with_header(frames, **changes):
    h = _header(frames)
    h.update(changes)
    return [msgpack.packb(h, use_bin_type=True), *frames[1:]]


@pytest.mark.parametrize("mutate, match", [
    (lambda f: _with_header(f, version=PROTOCOL_VERSION + 1), "unsupported protocol version"),
    (lambda f: _with_header(f, magic="nope"), "bad magic"),
    (lambda f: _with_header(f, type="launch_missiles"), "unknown message type"),
    (lambda f: _with_header(f, req_id=-1), "req_id"),
    (lambda f: _with_header(f, extra=1), "header keys"),
    (lambda f: f[:-1], "frames"),
    (lambda f: f + [b"x"], "frames"),
    (lambda f: [f[0], f[1][:-8], *f[2:]], "needs"),
    (lambda f: [b"\xc1garbage", *f[1:]], "msgpack"),
    (lambda f: [msgpack.packb([1, 2]), *f[1:]], "not a map"),
    (lambda f: [], "no frames"),
])
def test_malformed_frames_raise_protocol_error(mutate, match):
    frames = [bytes(x) for x in Speculate(1, ["a"], [0], [3], [0.0], req_id=5).encode()]
    with pytest.raises(ProtocolError, match=match):
        decode(mutate(frames))


def test_declared_dtype_shape_and_field_types_are_checked():
    frames = [bytes(x) for x in Speculate(1, ["a", "b"], [0, 1], [3, 4], [0.0, 1.0]).encode()]
    h = _header(frames)
    bad = dict(h, arrays=[["ks", "<i4", [2]], *h["arrays"][1:]])
    with pytest.raises(ProtocolError, match="dtype"):
        decode([msgpack.packb(bad), *frames[1:]])
    bad = dict(h, arrays=[["ks", "<i8", [1, 2]], *h["arrays"][1:]])
    with pytest.raises(ProtocolError, match="rank"):
        decode([msgpack.packb(bad), *frames[1:]])
    bad = dict(h, arrays=[["ks", "<i8", [3]], *h["arrays"][1:]])
    with pytest.raises(ProtocolError, match="bytes"):
        decode([msgpack.packb(bad), *frames[1:]])
    bad = dict(h, arrays=list(reversed(h["arrays"])))
    with pytest.raises(ProtocolError, match="schema"):
        decode([msgpack.packb(bad), *frames[1:]])
    for fields, match in [({"round_id": "1", "rids": ["a", "b"], "width": 0}, "round_id"),
                          ({"round_id": True, "rids": ["a", "b"], "width": 0}, "round_id"),
                          ({"round_id": 1, "rids": ["a", 3], "width": 0}, "rids"),
                          ({"round_id": 1, "rids": ["a", "a"], "width": 0}, "duplicate"),
                          ({"round_id": 1, "rids": ["a"], "width": 0}, "length"),
                          ({"round_id": 1, "rids": ["a", "b"], "width": -1}, "width"),
                          ({"round_id": 1, "rids": ["a", "b"], "width": 65}, "width"),
                          ({"round_id": 1, "rids": ["a", "b"], "width": 1.5}, "width"),
                          ({"round_id": 1, "rids": ["a", "b"]}, "missing"),
                          ({"round_id": 1, "rids": ["a", "b"], "width": 0, "x": 1}, "unexpected")]:
        with pytest.raises(ProtocolError, match=match):
            decode([msgpack.packb(dict(h, fields=fields)), *frames[1:]])


def test_semantic_validation():
    with pytest.raises(ProtocolError, match="ks"):
        Speculate(1, ["a"], [-2], [3], [0.0]).encode()
    with pytest.raises(ProtocolError, match="temperatures"):
        Speculate(1, ["a"], [0], [3], [float("nan")]).encode()
    with pytest.raises(ProtocolError, match="fan_out"):
        Hello(1, "c", 3, "async", [1, 1], 100).encode()
    with pytest.raises(ProtocolError, match="mode"):
        Hello(1, "c", 1, "turbo", [1, 1], 100).encode()
    with pytest.raises(ProtocolError, match="eos_ids"):
        Hello(1, "c", 1, "sync", [1, 1], 100, [100]).encode()
    with pytest.raises(ProtocolError, match="empty prompt"):
        Prefill(["a"], [[]], [0.0]).encode()
    with pytest.raises(ProtocolError, match="q_rows"):
        _reply(q_rows=(2, 0)).encode()
    with pytest.raises(ProtocolError, match="q"):
        SpecReply(round_id=1, tokens=np.zeros((2, 3)), hit=np.zeros(2, bool), q_rows=np.array([0]),
                  q=np.zeros((1, 2, 5), np.float16)).encode()
    with pytest.raises(ProtocolError, match="stats"):
        HealthReply(stats={"x": "y"}).encode()
    with pytest.raises(ProtocolError, match="resumed"):
        HelloReply(version=3, draft_vocab_size=96, draft_model_name="t", pid=1, resumed=1).encode()
    with pytest.raises(ProtocolError, match="longer"):
        Release(["x" * (P.MAX_STR + 1)]).encode()


def test_hello_same_session_compares_every_field_as_sent():
    a = Hello(PROTOCOL_VERSION, "c", 3, "async", [2, 1, 1, 2], 96, [1])
    assert a.same_session(Hello(PROTOCOL_VERSION, "c", 3, "async", [2, 1, 1, 2], 96, [1], req_id=9))
    for other in (Hello(PROTOCOL_VERSION, "d", 3, "async", [2, 1, 1, 2], 96, [1]),
                  Hello(PROTOCOL_VERSION, "c", 3, "sync", [2, 1, 1, 2], 96, [1]),
                  Hello(PROTOCOL_VERSION, "c", 3, "async", [2, 1, 1, 3], 96, [1]),
                  Hello(PROTOCOL_VERSION, "c", 3, "async", [2, 1, 1, 2], 96, []),
                  Hello(PROTOCOL_VERSION, "c", 3, "async", [2, 1, 1, 2], 96, [1], [2, 1, 1, 2]),
                  Hello(PROTOCOL_VERSION, "c", 3, "async", [2, 1, 1, 2], 96, [1], None, "fast"),
                  Hello(PROTOCOL_VERSION, "c", 3, "async", [2, 1, 1, 2], 96, [1], None, "neural", True)):
        assert not a.same_session(other)


def test_prefill_token_buffer_consistency():
    frames = [bytes(x) for x in Prefill(["a", "b"], [[1, 2], [3]], [0.0, 0.0]).encode()]
    lens = np.array([2, 2], dtype="<i8").tobytes()   # claims 4 tokens, buffer holds 3
    with pytest.raises(ProtocolError, match="lengths"):
        decode([frames[0], frames[1], lens, *frames[3:]])


def test_size_limits(monkeypatch):
    monkeypatch.setattr(framing, "MAX_HEADER_BYTES", 200)
    with pytest.raises(ProtocolError, match="header"):
        Release([f"r{i}" for i in range(100)]).encode()
    with pytest.raises(ProtocolError, match="header frame"):
        decode([b"\x80" * 201])
    monkeypatch.setattr(framing, "MAX_HEADER_BYTES", 4 << 20)
    monkeypatch.setattr(framing, "MAX_FRAME_BYTES", 64)
    with pytest.raises(ProtocolError):
        _reply().encode()
    with pytest.raises(ProtocolError, match="limit|bytes|outside"):
        frames = [bytes(x) for x in Speculate(1, ["a"] * 1, [0], [3], [0.0]).encode()]
        h = _header(frames)
        h["arrays"][0][2] = [1000]
        decode([msgpack.packb(h), b"\0" * 8000, *frames[2:]])
    monkeypatch.setattr(framing, "MAX_BATCH", 2)
    with pytest.raises(ProtocolError, match="longer"):
        Release(["a", "b", "c"]).encode()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=0, max_size=5))
def test_fuzz_random_frames_only_raise_protocol_error(frames):
    try:
        decode(frames)
    except ProtocolError:
        pass


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=True),
                     st.text(max_size=8), st.binary(max_size=8))
_values = st.recursive(_scalars, lambda c: st.one_of(st.lists(c, max_size=4),
                                                      st.dictionaries(st.text(max_size=6), c, max_size=4)),
                       max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([m for m in MESSAGES] + [_reply()]), st.data())
def test_fuzz_mutated_valid_headers(msg, data):
    """Replace one header field / array spec / buffer of a valid message with junk."""
    frames = [bytes(f) for f in msg.encode()]
    h = _header(frames)
    where = data.draw(st.sampled_from(["field", "array", "buffer", "top"]))
    if where == "field" and h["fields"]:
        h["fields"][data.draw(st.sampled_from(sorted(h["fields"])))] = data.draw(_values)
    elif where == "array" and h["arrays"]:
        i = data.draw(st.integers(0, len(h["arrays"]) - 1))
        h["arrays"][i][data.draw(st.integers(0, 2))] = data.draw(_values)
    elif where == "buffer" and len(frames) > 1:
        i = data.draw(st.integers(1, len(frames) - 1))
        frames[i] = data.draw(st.binary(max_size=64))
    else:
        h[data.draw(st.sampled_from(sorted(h)))] = data.draw(_values)
    try:
        out = decode([msgpack.packb(h, use_bin_type=True), *frames[1:]])
    except ProtocolError:
        return
    out.encode()  # whatever passed validation must be re-encodable


def test_prefill_saguaro_c_round_trip_and_range():
    msg = decode([bytes(x) for x in Prefill(["a", "b"], [[1, 2], [3]], [0.7, 0.0], [0.5, 1.0]).encode()])
    assert msg.saguaro_c == [0.5, 1.0]
    assert decode([bytes(x) for x in Prefill(["a"], [[1]], [1.0]).encode()]).saguaro_c == [1.0]  # default
    for bad in ([0.0], [1.5], [float("nan")]):
        with pytest.raises(ProtocolError, match="saguaro_c"):
            Prefill(["a"], [[1]], [1.0], bad).encode()
    with pytest.raises(ProtocolError):
        Prefill(["a", "b"], [[1], [2]], [1.0, 1.0], [0.5]).encode()


def test_speculate_features_round_trip_and_checks():
    """An EAGLE-3 draft's target features: rows per request, stacked; checked against feat_lens."""
    feats = np.arange(5 * 6, dtype=np.float16).reshape(5, 6)
    msg = Speculate(3, ["a", "b"], [1, -1], [4, 5], [0.0, 1.0], feat_starts=[10, 0], feat_lens=[2, 3],
                    features=feats)
    got = decode([bytes(f) for f in msg.encode()])
    start, rows = got.features_of(1)
    assert start == 0 and np.array_equal(rows, feats[2:]) and got.features_of(0)[0] == 10
    plain = decode([bytes(f) for f in Speculate(1, ["a"], [0], [2], [0.0]).encode()])
    assert plain.features_of(0)[1].shape[0] == 0  # a standalone draft's Speculate: no features
    with pytest.raises(ProtocolError, match="sum\\(feat_lens\\)"):
        Speculate(3, ["a", "b"], [1, -1], [4, 5], [0.0, 1.0], feat_starts=[10, 0], feat_lens=[2, 2],
                  features=feats).encode()
    with pytest.raises(ProtocolError, match="feat_starts"):
        Speculate(3, ["a", "b"], [1, -1], [4, 5], [0.0, 1.0], feat_starts=[10], feat_lens=[2, 3],
                  features=feats).encode()
    with pytest.raises(ProtocolError, match=">= 0"):
        Speculate(3, ["a", "b"], [1, -1], [4, 5], [0.0, 1.0], feat_starts=[10, 0], feat_lens=[6, -1],
                  features=feats).encode()
    r = HelloReply(PROTOCOL_VERSION, 96, "d", 1, feature_layers=[1, 14, 26], feature_dim=1728)
    assert decode([bytes(f) for f in r.encode()]).feature_layers == [1, 14, 26]
    with pytest.raises(ProtocolError, match="feature_dim"):
        HelloReply(PROTOCOL_VERSION, 96, "d", 1, feature_layers=[1], feature_dim=0).encode()
