"""The prepared model pair: all three load (HF where the format allows, and our draft runner), the drafts
share the target's tokenizer and vocabulary exactly, and the trained draft's reduced head gives q = 0 off
its token subset on every path the draft uses."""

import filecmp
import json
import os

import pytest
import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(params=["trained", "lens"])
def any_draft(request, draft_path, lens_draft_path):
    return draft_path if request.param == "trained" else lens_draft_path


def test_pair_loads_and_shares_tokenizer(target_path, any_draft):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    t_cfg, d_cfg = AutoConfig.from_pretrained(target_path), AutoConfig.from_pretrained(any_draft)
    assert t_cfg.vocab_size == d_cfg.vocab_size == 49152
    assert (t_cfg.bos_token_id, t_cfg.eos_token_id) == (d_cfg.bos_token_id, d_cfg.eos_token_id) == (1, 2)
    assert d_cfg.num_hidden_layers < t_cfg.num_hidden_layers
    for name in TOKENIZER_FILES:
        assert filecmp.cmp(os.path.join(target_path, name), os.path.join(any_draft, name), shallow=False), name
    t_tok, d_tok = AutoTokenizer.from_pretrained(target_path), AutoTokenizer.from_pretrained(any_draft)
    text = "The capital of France is Paris.\ndef f(x):\n    return x ** 2  # naïve 東京"
    assert t_tok(text)["input_ids"] == d_tok(text)["input_ids"]
    assert t_tok.get_vocab() == d_tok.get_vocab()
    paths = (target_path,) if getattr(d_cfg, "ssd_head_vocab", None) else (target_path, any_draft)
    for path in paths:  # the trained draft's reduced head is not a transformers layout: see the test below
        marker = json.load(open(os.path.join(path, "PREPARED.json")))
        assert marker["files"]["model.safetensors"]["bytes"] > 100_000_000
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ids = torch.tensor([t_tok("The capital of France is")["input_ids"]])
        with torch.no_grad():
            logits = model(ids).logits[0, -1]
        assert torch.isfinite(logits).all()
        if path == target_path:  # the real trained model, not noise
            assert t_tok.decode([int(logits.argmax())]).strip() == "Paris"


def test_draft_runner_matches_hf_on_the_lens_draft(lens_draft_path):
    """Our draft process's runner computes the same logits as transformers for the prepared lens draft."""
    from transformers import AutoModelForCausalLM

    from sglang_ssd.draft.runner import DraftRunner, ForwardItem

    runner = DraftRunner.from_dir(lens_draft_path, "cpu", "float32")
    ids = [1, 504, 3575, 282, 4649, 314]
    kv = runner.new_kv(len(ids) + 4)
    ours = runner.forward([ForwardItem.extend(kv, ids, 0)])[0]
    hf = AutoModelForCausalLM.from_pretrained(lens_draft_path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    assert (ours[-1].float() - ref).abs().max() < 2e-3
    assert int(ours[-1].argmax()) == int(ref.argmax())


def test_trained_draft_reduced_head(target_path, draft_path):
    """Logits are finite exactly on head_ids (special ids included); the runner's rows equal a plain
    forward of the same model; sampled proposals never leave the subset and their q is 0 off it."""
    from sglang_ssd.draft.model import load_model
    from sglang_ssd.draft.runner import DraftRunner, ForwardItem
    from sglang_ssd.draft.sampling import sample_rows

    cfg = json.load(open(os.path.join(draft_path, "config.json")))
    marker = json.load(open(os.path.join(draft_path, "PREPARED.json")))
    assert marker["recipe_version"] == 3 and cfg["ssd_head_vocab"] == marker["params"]["head_vocab"]
    from sglang_ssd.saguaro.datastore import load_for
    store = load_for(draft_path)  # built from assets/gen's answers at assembly (scripts/trained_draft.py)
    assert store is not None and len(store) == marker["datastore"] > 1_000_000
    model = load_model(draft_path)
    head = model.head_ids
    assert head.numel() == cfg["ssd_head_vocab"] < cfg["vocab_size"] and {0, 1, 2} <= set(head.tolist())
    runner = DraftRunner(model)
    ids = [1, 504, 3575, 282, 4649, 314, 2, 198, 1, 9690, 198]
    kv = runner.new_kv(len(ids) + 4)
    z = runner.forward([ForwardItem.extend(kv, ids, 0, n_logits=len(ids))])[0]
    inside = torch.zeros(z.shape[-1], dtype=torch.bool)
    inside[head] = True
    assert torch.isfinite(z[:, inside]).all() and torch.isneginf(z[:, ~inside]).all()
    with torch.no_grad():
        ref = model.logits(model.forward_padded(torch.tensor([ids]))[0])
    assert torch.allclose(z[:, inside], ref[:, inside], atol=1e-4)
    g = torch.Generator().manual_seed(0)
    rows = z.repeat(40, 1)
    toks, q16 = sample_rows(rows, torch.full((rows.shape[0],), 1.3), generator=g)
    assert inside[toks].all()
    assert (q16[:, ~inside] == 0).all() and torch.allclose(q16.float().sum(-1), torch.ones(rows.shape[0]), atol=1e-2)
    greedy, _ = sample_rows(z, torch.zeros(z.shape[0]))
    assert inside[greedy].all()
