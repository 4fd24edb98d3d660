"""The prepared model pair: both load (HF and our draft runner), and the draft shares the target's
tokenizer and vocabulary exactly."""

import filecmp
import json
import os

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def test_pair_loads_and_shares_tokenizer(target_path, draft_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    t_cfg, d_cfg = AutoConfig.from_pretrained(target_path), AutoConfig.from_pretrained(draft_path)
    assert t_cfg.vocab_size == d_cfg.vocab_size == 49152
    assert (t_cfg.bos_token_id, t_cfg.eos_token_id) == (d_cfg.bos_token_id, d_cfg.eos_token_id) == (1, 2)
    assert d_cfg.num_hidden_layers < t_cfg.num_hidden_layers
    for name in TOKENIZER_FILES:
        assert filecmp.cmp(os.path.join(target_path, name), os.path.join(draft_path, name), shallow=False), name
    t_tok, d_tok = AutoTokenizer.from_pretrained(target_path), AutoTokenizer.from_pretrained(draft_path)
    text = "The capital of France is Paris.\ndef f(x):\n    return x ** 2  # naïve 東京"
    assert t_tok(text)["input_ids"] == d_tok(text)["input_ids"]
    assert t_tok.get_vocab() == d_tok.get_vocab()
    for path in (target_path, draft_path):
        marker = json.load(open(os.path.join(path, "PREPARED.json")))
        assert marker["files"]["model.safetensors"]["bytes"] > 100_000_000
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ids = torch.tensor([t_tok("The capital of France is")["input_ids"]])
        with torch.no_grad():
            logits = model(ids).logits[0, -1]
        assert torch.isfinite(logits).all()
        if path == target_path:  # the real trained model, not noise
            assert t_tok.decode([int(logits.argmax())]).strip() == "Paris"


def test_draft_runner_matches_hf_on_the_real_draft(draft_path):
    """Our draft process's runner computes the same logits as transformers for the prepared draft."""
    from transformers import AutoModelForCausalLM

    from sglang_ssd.draft.runner import DraftRunner, ForwardItem

    runner = DraftRunner.from_dir(draft_path, "cpu", "float32")
    ids = [1, 504, 3575, 282, 4649, 314]
    kv = runner.new_kv(len(ids) + 4)
    ours = runner.forward([ForwardItem.extend(kv, ids, 0)])[0]
    hf = AutoModelForCausalLM.from_pretrained(draft_path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    assert (ours[-1].float() - ref).abs().max() < 2e-3
    assert int(ours[-1].argmax()) == int(ref.argmax())
