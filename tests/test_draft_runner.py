"""Draft runner vs transformers on tiny random checkpoints; KV cache, batching and sampling contract."""

from __future__ import annotations

import pytest
import torch

from sglang_ssd.draft.config import ModelConfig
from sglang_ssd.draft.runner import DraftRunner, ForwardItem
from sglang_ssd.draft.sampling import proposal_wire, sample_rows
from sglang_ssd.saguaro.proposal import dequantize_proposal, proposal_from_logits, quantize_proposal
from tests.tiny_models import load_hf, make_tiny_model

torch.set_num_threads(1)

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
CASES = {
    "llama-gqa": dict(kind="llama"),
    "llama-tied-llama3rope": dict(kind="llama", tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE),
    "qwen3-qknorm": dict(kind="qwen3"),
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request):
    path = make_tiny_model(**CASES[request.param])
    return DraftRunner.from_dir(path), load_hf(path)


def test_prefill_and_incremental_decode_match_transformers(pair):
    runner, hf = pair
    torch.manual_seed(1)
    ids = torch.randint(0, runner.vocab_size, (48,))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    # prefill of the first 30 tokens: logits of every row
    kv = runner.new_kv(capacity=8)  # tiny capacity: forces several doublings
    out = runner.forward([ForwardItem.extend(kv, ids[:30].tolist(), 0, n_logits=30)])[0]
    torch.testing.assert_close(out, ref[:30], atol=2e-5, rtol=1e-5)
    # then one token at a time against the same cache
    for t in range(30, 48):
        step = runner.forward([ForwardItem.extend(kv, [int(ids[t])], t)])[0]
        torch.testing.assert_close(step[0], ref[t], atol=2e-5, rtol=1e-5)
    assert kv.capacity >= 48


def test_ragged_batch_equals_single_requests():
    runner = DraftRunner.from_dir(make_tiny_model())
    torch.manual_seed(2)
    prompts = [torch.randint(0, 96, (n,)).tolist() for n in (5, 17, 1)]
    singles = [runner.forward([ForwardItem.extend(runner.new_kv(), p, 0, len(p))])[0] for p in prompts]
    kvs = [runner.new_kv() for _ in prompts]
    batched = runner.forward([ForwardItem.extend(kv, p, 0, len(p)) for kv, p in zip(kvs, prompts)])
    for a, b in zip(singles, batched):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # a mixed extend step on top of the batched caches (ragged q and kv lengths)
    steps = runner.forward([ForwardItem.extend(kv, [3, 4][: 1 + i % 2], len(p), 1)
                            for i, (kv, p) in enumerate(zip(kvs, prompts))])
    for i, (p, s) in enumerate(zip(prompts, steps)):
        ctx = p + [3, 4][: 1 + i % 2]
        ref = runner.forward([ForwardItem.extend(runner.new_kv(), ctx, 0, 1)])[0]
        torch.testing.assert_close(s, ref, atol=1e-5, rtol=1e-5)


def test_bfloat16_runs_and_roughly_agrees():
    path = make_tiny_model()
    r32, r16 = DraftRunner.from_dir(path), DraftRunner.from_dir(path, dtype="bfloat16")
    assert r16.dtype == torch.bfloat16 and r16.new_kv().k.dtype == torch.bfloat16
    ids = list(range(20))
    a = r32.forward([ForwardItem.extend(r32.new_kv(), ids, 0, 20)])[0]
    b = r16.forward([ForwardItem.extend(r16.new_kv(), ids, 0, 20)])[0]
    assert b.dtype == torch.float32
    assert (a - b).abs().max() < 0.1 * a.abs().max()


def test_config_parsing_legacy_rope_fields():
    cfg = ModelConfig.from_hf_dict({"model_type": "llama", "vocab_size": 10, "hidden_size": 8,
                                    "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                                    "rope_theta": 1234.0, "max_position_embeddings": 64,
                                    "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert cfg.rope_theta == 1234.0 and cfg.num_kv_heads == 2 and cfg.head_dim == 4
    torch.testing.assert_close(cfg.inv_freq(), 0.5 / 1234.0 ** (torch.arange(0, 4, 2).float() / 4))
    with pytest.raises(ValueError):
        ModelConfig.from_hf_dict({"model_type": "gpt2"})
    with pytest.raises(ValueError):
        ModelConfig.from_hf_dict({"model_type": "llama", "vocab_size": 10, "hidden_size": 8,
                                  "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                                  "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})


def test_sampling_contract_is_bit_exact():
    """The draft samples from exactly proposal_from_logits(z, T) and the wire bytes dequantise to it."""
    torch.manual_seed(3)
    z = torch.randn(64, 500) * 4
    temps = torch.tensor([0.7] * 32 + [1.3] * 32)
    q, q16 = proposal_wire(z, temps)
    assert q16.dtype == torch.float16
    assert torch.equal(q, proposal_from_logits(z, temps))
    assert torch.equal(dequantize_proposal(q16), q)
    assert torch.equal(q16, quantize_proposal(torch.softmax(z / temps[:, None], -1)))


def test_sample_rows_greedy_and_sampled_rows():
    torch.manual_seed(4)
    z = torch.randn(6, 50) * 3
    temps = [0.0, 1.0, 0.0, 0.5, 2.0, 0.0]
    tok, q16 = sample_rows(z, temps, torch.Generator().manual_seed(0))
    for i, t in enumerate(temps):
        if t == 0:
            assert tok[i] == z[i].argmax() and not q16[i].any()
        else:
            assert q16[i][tok[i]] > 0
            assert torch.equal(dequantize_proposal(q16[i]), proposal_from_logits(z[i], t))
    tok, q16 = sample_rows(z, [0.0] * 6)
    assert q16 is None and torch.equal(tok, z.argmax(-1))
    # sampling follows q: empirical frequencies of a 3-token distribution
    z3 = torch.log(torch.tensor([[0.6, 0.3, 0.1]])).repeat(4000, 1)
    tok, _ = sample_rows(z3, [1.0] * 4000, torch.Generator().manual_seed(1))
    freq = torch.bincount(tok, minlength=3).float() / 4000
    torch.testing.assert_close(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.03, rtol=0)


@pytest.mark.parametrize("mixed", [False, True])
def test_sample_rows_on_a_reduced_head_support(mixed):
    """A reduced head (q = 0 off its subset): sampling over the subset only gives the same q (up to
    float rounding of the softmax sum), zero q16 off the subset, tokens only from the subset, the
    law of q (chi-square-style bound on 6000 draws), and the same greedy rows."""
    g = torch.Generator().manual_seed(5)
    v = 300
    support = torch.randperm(v, generator=g)[:40].sort().values
    z = torch.full((6000, v), float("-inf"))
    base = torch.randn(40, generator=g) * 2
    z[:, support] = base
    temps = torch.full((6000,), 1.0)
    if mixed:
        temps[::7] = 0.0
    tok, q16 = sample_rows(z, temps, torch.Generator().manual_seed(3), support=support)
    ref_tok, ref_q16 = sample_rows(z[:50], temps[:50], torch.Generator().manual_seed(3))
    off = torch.ones(v, dtype=torch.bool)
    off[support] = False
    assert not q16[:, off].any() and torch.isin(tok, support).all()
    torch.testing.assert_close(dequantize_proposal(q16[:50]), dequantize_proposal(ref_q16), atol=1e-3, rtol=0)
    greedy = temps == 0
    assert torch.equal(tok[greedy], z[greedy].argmax(-1))
    p = dequantize_proposal(q16[~greedy][0])
    freq = torch.bincount(tok[~greedy], minlength=v).float() / int((~greedy).sum())
    assert (freq - p).abs().max() < 0.03
    assert torch.equal(dequantize_proposal(q16[~greedy][0]), dequantize_proposal(q16[~greedy][1]))
