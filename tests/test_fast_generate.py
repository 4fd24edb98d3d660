"""scripts/fast_generate.py: the static-KV batched sampler that makes distillation data (issue 15).

Its labels must be the target's real distributions and its samples real draws from them, so every
step is checked against transformers' model on the full sequence (no cache), for prompts of mixed
lengths sharing one batch."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from sglang_ssd.draft.model import load_model
from tests.tiny_models import load_hf, make_tiny_model

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from fast_generate import StaticBatchGenerator  # noqa: E402

V = 96
PROMPTS = [[5, 9, 17], [3] * 11, [40, 41], [7, 8, 9, 10, 11, 12, 13]]


@pytest.fixture(scope="module")
def pair():
    path = make_tiny_model(vocab_size=V, seed=3, num_hidden_layers=3)
    return StaticBatchGenerator(load_model(path)), load_hf(path)


def _full_probs(hf, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.softmax(hf(torch.tensor([seq])).logits[0].float(), -1)


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_labels_and_tokens_match_a_full_forward(pair, temperature):
    gen, hf = pair
    out = gen.generate(PROMPTS, 6, temperature, seed=1, eos_id=None, topk=8)
    assert [len(t) for t in out.tokens] == [6] * len(PROMPTS)
    for p, toks, ids, probs in zip(PROMPTS, out.tokens, out.topk_ids, out.topk_p):
        ref = _full_probs(hf, p + toks)[len(p) - 1: len(p) - 1 + len(toks)]  # distribution of each new token
        val, idx = ref.topk(8, -1)
        assert torch.equal(ids.long(), idx)
        torch.testing.assert_close(probs.float(), val, atol=2e-3, rtol=0)  # stored as float16
        if temperature == 0:
            assert toks == ref.argmax(-1).tolist()
        else:  # a real draw: every sampled token has probability > 0 under the T-scaled distribution
            assert all(float(ref[j, t]) > 0 for j, t in enumerate(toks))


def test_rows_stop_at_eos_and_keep_it(pair):
    gen, _ = pair
    greedy = gen.generate(PROMPTS, 6, 0.0, seed=0, eos_id=None, topk=4).tokens
    eos = greedy[1][2]  # row 1's third token: that row must stop there, EOS kept
    out = gen.generate(PROMPTS, 6, 0.0, seed=0, eos_id=eos, topk=4)
    for row, full in zip(out.tokens, greedy):
        n = full.index(eos) + 1 if eos in full else len(full)
        assert row == full[:n]
    assert len(out.tokens[1]) <= 3 and out.tokens[1][-1] == eos
    assert [t.shape[0] for t in out.topk_ids] == [len(t) for t in out.tokens]


def test_sampling_is_seeded_and_sensitive_to_the_seed(pair):
    gen, _ = pair
    a = gen.generate(PROMPTS, 8, 1.0, seed=5, eos_id=None).tokens
    assert gen.generate(PROMPTS, 8, 1.0, seed=5, eos_id=None).tokens == a
    assert gen.generate(PROMPTS, 8, 1.0, seed=6, eos_id=None).tokens != a


def test_empty_prompt_is_refused(pair):
    gen, _ = pair
    with pytest.raises(ValueError, match="at least one token"):
        gen.generate([[1, 2], []], 4, 0.0, seed=0, eos_id=None)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_are_refilled_from_the_waiting_prompts(pair, temperature):
    """4 prompts on 2 rows, EOS ending some answers early: every answer's labels still equal a full
    forward's over its own prompt + answer (stale slots of a reused row are never visible)."""
    gen, hf = pair
    prompts = PROMPTS + [[2, 3, 4, 5, 6], [60] * 4]
    eos = gen.generate(prompts[:1], 3, 0.0, seed=0, eos_id=None).tokens[0][1]
    out = gen.generate(prompts, 7, temperature, seed=2, eos_id=eos, topk=8, batch=2)
    assert len(out.tokens) == len(prompts) and all(1 <= len(t) <= 7 for t in out.tokens)
    for p, toks, ids in zip(prompts, out.tokens, out.topk_ids):
        assert toks[-1] == eos or len(toks) == 7
        ref = _full_probs(hf, p + toks)[len(p) - 1: len(p) - 1 + len(toks)]
        assert torch.equal(ids.long(), ref.topk(8, -1).indices)
    if temperature == 0:  # greedy answers do not depend on which row or batch served them
        alone = gen.generate(prompts, 7, 0.0, seed=2, eos_id=eos, topk=8)
        assert alone.tokens == out.tokens


def test_draft_data_generation_shard_layout(pair):
    """draft_data's gen job: sequences = prompt + answer, one label per answer token at the position
    before it, the labels the generator computed (its T = 1 top-k)."""
    from types import SimpleNamespace

    import draft_data

    gen, _ = pair
    eos = 1
    shard = draft_data.generate(gen, SimpleNamespace(eos_token_id=eos), PROMPTS, 1.0, seed=4)
    out = gen.generate(PROMPTS, draft_data.GEN_TOKENS, 1.0, 4, eos_id=eos, topk=draft_data.TOPK,
                       batch=draft_data.GEN_ROWS)
    off = shard["offsets"].tolist()
    assert len(off) == len(PROMPTS) + 1 and off[-1] == shard["tokens"].numel()
    labelled = shard["label_pos"].tolist()
    for i, (p, ans) in enumerate(zip(PROMPTS, out.tokens)):
        seq = shard["tokens"][off[i]:off[i + 1]].tolist()
        assert seq == p + ans
        pos = [x - off[i] for x in labelled if off[i] <= x < off[i + 1]]
        assert pos == list(range(len(p) - 1, len(p) - 1 + len(ans)))
    assert torch.equal(shard["topk_ids"], torch.cat(out.topk_ids))
    assert shard["topk_ids"].shape == (len(labelled), draft_data.TOPK) and shard["topk_p"].dtype == torch.float16


def test_tokens_only_answers_relabel_to_the_same_shard(pair, tmp_path, monkeypatch):
    """draft_data's tokens-only export (what gets committed: answers are slow to sample, labels big) and
    its teacher-forced re-labelling give back the shard generation wrote: same tokens, offsets, labelled
    positions and top-k labels.  Rows of different lengths (EOS ends some) share the padded batches."""
    from types import SimpleNamespace

    import numpy as np
    from safetensors.torch import save_file

    import draft_data

    gen, hf = pair
    monkeypatch.setattr(draft_data, "GEN_TOKENS", 7)
    prompts = PROMPTS * 5
    shard = draft_data.generate(gen, SimpleNamespace(eos_token_id=11), prompts, 1.0, seed=4)
    lens = (shard["offsets"][1:] - shard["offsets"][:-1]).tolist()
    assert len(set(lens)) > len(set(len(p) for p in PROMPTS))  # EOS really shortened some answers
    src = tmp_path / "data"
    src.mkdir()
    save_file(shard, str(src / "shard_00005_gen.safetensors"))
    save_file(shard, str(src / "shard_00006_text.safetensors"))  # text shards are not exported
    assert draft_data.export_gen(tmp_path / "gen", src) == len(shard["label_pos"])
    files = sorted(p.name for p in (tmp_path / "gen").iterdir())
    assert files == ["gen_00005.npz"]
    z = np.load(tmp_path / "gen" / files[0])
    assert z["tokens"].dtype == np.uint16 and z["tokens"].nbytes == 2 * len(shard["tokens"])
    back = draft_data.relabel(hf, torch.from_numpy(z["tokens"].astype(np.int32)), torch.from_numpy(z["offsets"]),
                              torch.from_numpy(z["prompt_lens"]), batch=3)
    for key in ("tokens", "offsets", "label_pos"):
        assert torch.equal(back[key], shard[key]), key
    assert torch.equal(back["topk_ids"][:, :4], shard["topk_ids"][:, :4])  # the top labels; ties past them may swap
    torch.testing.assert_close(back["topk_p"].float(), shard["topk_p"].float(), atol=2e-3, rtol=0)
    assert z["prompt_lens"].tolist() == [len(p) for p in prompts]
    # hard labels: the token generated after each labelled position, probability 1
    hard = draft_data.hard_label(*(torch.from_numpy(x) for x in (z["tokens"].astype(np.int32), z["offsets"],
                                                                z["prompt_lens"])))
    assert torch.equal(hard["label_pos"], shard["label_pos"])
    assert hard["topk_ids"].shape == (len(shard["label_pos"]), 1) and bool((hard["topk_p"] == 1).all())
    assert torch.equal(hard["topk_ids"][:, 0].long(), shard["tokens"][shard["label_pos"] + 1].long())
    greedy = draft_data.generate(gen, SimpleNamespace(eos_token_id=11), PROMPTS, 0.0, seed=4)
    gz = [greedy[k] for k in ("tokens", "offsets")] + [torch.tensor([len(p) for p in PROMPTS], dtype=torch.int32)]
    assert torch.equal(draft_data.hard_label(*gz)["topk_ids"][:, 0], greedy["topk_ids"][:, 0])  # T = 0: argmax


def test_draft_data_skips_jobs_already_done_or_exported(tmp_path):
    """A fresh machine (no data directory) must not sample the committed answers again: a generation job
    whose tokens are exported counts as done; a text job only by its own shard; neither otherwise."""
    import draft_data

    out, exported = tmp_path / "data", tmp_path / "gen"
    out.mkdir()
    exported.mkdir()
    (exported / "gen_00005.npz").write_bytes(b"")
    (out / "shard_00006_text.safetensors").write_bytes(b"")
    assert draft_data.job_done(5, "gen", out, exported)
    assert not draft_data.job_done(5, "gen", out, None)  # --skip-exported off
    assert not draft_data.job_done(10, "gen", out, exported)
    assert draft_data.job_done(6, "text", out, exported)
    assert not draft_data.job_done(7, "text", out, exported)
    (out / "shard_00010_gen.safetensors").write_bytes(b"")
    assert draft_data.job_done(10, "gen", out, exported)
