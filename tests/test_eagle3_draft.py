"""An EAGLE-3 head driven by the draft engine (runner passes, feature buffer, cache build, backup):
every proposal equals a slow reference decode that recomputes the whole context position by position,
each slot t reading the target's feature of slot t - 1 where the worker had sent it by then and the
draft's own output of slot t - 1 beyond, so the features really flow through every path."""

import random

import pytest
import torch

from sglang_ssd.draft.eagle3 import load_eagle3
from sglang_ssd.draft.engine import DraftEngine
from sglang_ssd.draft.features import MAX_SEQUENTIAL, FeatureBuffer, parents_of, split_extend
from sglang_ssd.draft.runner import DraftRunner
from sglang_ssd.protocol import PROTOCOL_VERSION, Hello, Prefill, Speculate, decode
from tests.test_eagle3_model import DT, V, _causal, _weights, _write

# proposals are compared with the draft's own decode: the prompt lookup off (conftest.no_lookup)
pytestmark = pytest.mark.usefixtures("no_lookup")

K = 3


def _wire(msg):
    return decode([bytes(f) for f in msg.encode()])


@pytest.fixture()
def model(tmp_path):
    w, _ = _weights(seed=5, with_embed=True)
    return load_eagle3(_write(tmp_path, w), target_layers=30)


@torch.no_grad()
def _reference(model, tokens, aux, n_target, k):
    """Greedy K tokens after `tokens`, target features (projected aux rows) at positions < n_target."""
    seq, feats, out = list(tokens), [torch.zeros(model.cfg.base.hidden_size)], []
    proj = model.project(aux)
    t = 0
    while len(out) < k:
        while t < len(seq):  # slot t: the prefix recomputed (causal, so rows < t are unchanged)
            ids = torch.tensor(seq[: t + 1])
            hidden, nxt = model(ids, torch.arange(t + 1), torch.stack(feats[: t + 1]), _causal)
            feats.append(proj[t] if t < n_target else nxt[-1])
            t += 1
        col = int(model.head_logits(hidden[-1:]).argmax())
        seq.append(int(model.head_ids[col]))
        out.append(seq[-1])
    return out


def _speculate(e, rnd, rid, k, bonus, aux, fed, committed):
    """Speculate with the target's features of positions fed .. committed - 2 (all but the new bonus)."""
    rows = aux[fed: committed - 1]
    msg = Speculate(rnd, [rid], [k], [bonus], [0.0], feat_starts=[fed], feat_lens=[rows.shape[0]],
                    features=rows.half().numpy())
    return e.speculate(_wire(msg)), committed - 1


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_proposals_match_the_reference_decode(model, mode):
    runner = DraftRunner(model)
    assert runner.feature_layers == [1, 14, 26] and runner.feature_dim == 3 * DT
    e = DraftEngine(runner, seed=0)
    reply = e.hello(Hello(PROTOCOL_VERSION, "t", K, mode, [2] * (K + 1), V, []))
    assert reply.feature_layers == [1, 14, 26] and reply.feature_dim == 3 * DT
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    prompt = [rng.randrange(V) for _ in range(9)]
    aux = torch.randn(200, 3 * DT, generator=g).half().float()  # what the wire carries
    e.prefill(Prefill(["r"], [prompt], [0.0]))
    ctx, fed, spec = list(prompt), 0, []
    hits = 0
    for rnd in range(12):
        k = rng.randint(0, len(spec))
        keys = [b for (j, b) in e.cache.keys("r") if j == k] if mode == "async" else []
        bonus = rng.choice(keys) if keys and rng.random() < 0.7 else rng.randrange(V)
        ctx = ctx + spec[:k] + [bonus]
        known_before = fed  # what the draft had when it built this round's cache
        reply, fed = _speculate(e, rnd, "r", k, bonus, aux, fed, len(ctx))
        spec = reply.tokens[0].tolist()
        hit = bool(reply.hit[0])
        hits += hit
        # a hit was drafted before this round's features came; a backup after them
        want = _reference(model, ctx, aux, known_before if hit else fed, K)
        assert spec == want, (rnd, hit, spec, want)
        if mode == "async":
            e.build_cache()
    if mode == "async":
        assert hits >= 3  # the cache path was exercised, not only the backup


def test_features_reach_the_draft(model):
    """A negative control for the test above: other target features give other proposals."""
    runner = DraftRunner(model)
    outs = []
    for seed in (1, 2):
        e = DraftEngine(runner, seed=0)
        e.hello(Hello(PROTOCOL_VERSION, "t", K, "sync", [2] * (K + 1), V, []))
        prompt = list(range(10, 22))
        aux = torch.randn(40, 3 * DT, generator=torch.Generator().manual_seed(seed))
        e.prefill(Prefill(["r"], [prompt], [0.0]))
        reply, _ = _speculate(e, 0, "r", 0, 7, aux, 0, len(prompt) + 1)
        outs.append(reply.tokens[0].tolist())
    assert outs[0] != outs[1]


def test_feature_buffer_and_passes():
    fb = FeatureBuffer(4, torch.float32, "cpu", 8)
    fb.put_target(0, torch.ones(3, 4))
    fb.store(torch.tensor([2, 3, 4]), torch.full((3, 4), 5.0))  # slot 2 keeps its target row
    assert fb.h[2].tolist() == [1.0] * 4 and fb.h[3].tolist() == [5.0] * 4
    assert fb.gather(torch.tensor([-1, 3])).tolist() == [[0.0] * 4, [5.0] * 4]
    # rows 1..3 read target parents (slots 0..2): one pass; rows 4.. one each (their parent is in-forward)
    assert split_extend(fb, 0, 6) == [(0, 4), (4, 5), (5, 6)]
    assert split_extend(fb, 5, 2 + MAX_SEQUENTIAL) == [(0, 2 + MAX_SEQUENTIAL)]  # a long run: one pass
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, [0, 1, 2, 6]] = True  # a tree row at slot 6 forking from slot 2
    mask[1, [0, 1, 2, 6, 7]] = True  # its child at slot 7
    assert parents_of(torch.tensor([6, 7]), mask).tolist() == [2, 6]
    assert parents_of(torch.tensor([4, 5]), None).tolist() == [3, 4]


def test_bad_features_are_rejected_whole(model, tmp_path):
    """Features of the wrong width, or for the uncommitted bonus, are an error naming the rows; a
    standalone draft refuses features; nothing changes on the draft."""
    from sglang_ssd.draft.engine import EngineError
    from tests.tiny_models import make_tiny_model

    e = DraftEngine(DraftRunner(model), seed=0)
    e.hello(Hello(PROTOCOL_VERSION, "t", K, "sync", [2] * (K + 1), V, []))
    e.prefill(Prefill(["r"], [[1, 2, 3]], [0.0]))
    aux = torch.randn(8, 3 * DT)
    with pytest.raises(EngineError, match="past the last committed"):
        _speculate(e, 0, "r", 0, 5, aux, 0, 5)  # positions 0..3: 3 is the new bonus, not yet run
    with pytest.raises(EngineError, match="width"):
        e.speculate(_wire(Speculate(0, ["r"], [0], [5], [0.0], feat_starts=[0], feat_lens=[1],
                                    features=torch.zeros(1, 7).half().numpy())))
    assert e.requests["r"].tokens == [1, 2, 3]  # unchanged: the same round can be sent again
    reply, _ = _speculate(e, 0, "r", 0, 5, aux, 0, 4)
    assert reply.tokens.shape == (1, K)
    plain = DraftEngine(DraftRunner.from_dir(make_tiny_model(vocab_size=V, seed=1)), seed=0)
    plain.hello(Hello(PROTOCOL_VERSION, "t", K, "sync", [2] * (K + 1), V, []))
    plain.prefill(Prefill(["r"], [[1, 2, 3]], [0.0]))
    with pytest.raises(EngineError, match="0: none"):
        _speculate(plain, 0, "r", 0, 5, aux, 0, 4)
