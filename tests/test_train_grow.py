"""train_draft --grow: a deeper student starts as exactly the exported draft it grows from."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from tests.tiny_models import random_state_dict, tiny_hf_config  # noqa: E402
from train_draft import load_init  # noqa: E402

from sglang_ssd.draft.config import ModelConfig  # noqa: E402
from sglang_ssd.draft.model import CausalLM  # noqa: E402


def _student(layers: int, seed: int) -> CausalLM:
    hf = tiny_hf_config(num_hidden_layers=layers)
    m = CausalLM(ModelConfig.from_hf_dict(hf))
    m.load_state_dict(random_state_dict(hf, seed=seed, std=0.3), strict=False)
    return m.eval()


def _init_without_embedding(m: CausalLM) -> dict:
    # exported drafts store no embedding (shared with the target) and fp16 parameters
    return {k: v.half() for k, v in m.state_dict().items() if k != "model.embed_tokens.weight"}


def test_grown_student_computes_the_init_drafts_logits():
    small = _student(2, seed=1)
    big = _student(4, seed=2)  # layers 2-3 stand for the target's next layers (nonzero weights)
    big.model.embed_tokens.weight.data.copy_(small.model.embed_tokens.weight)
    init = _init_without_embedding(small)
    small.load_state_dict({k: v.float() for k, v in init.items()}, strict=False)  # same fp16 rounding
    grown = load_init(big, init, grow=True, what="test")
    assert grown == [2, 3]
    ids = torch.randint(0, 96, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = small.logits(small.forward_padded(ids))
        got = big.logits(big.forward_padded(ids))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # the grown layers keep trainable nonzero reads, so gradients reach them
    assert big.model.layers[2].self_attn.q_proj.weight.abs().sum() > 0
    assert big.model.layers[3].mlp.down_proj.weight.abs().sum() == 0


def test_negative_control_grown_layers_left_as_they_were_change_the_logits():
    small, big = _student(2, seed=1), _student(4, seed=2)
    big.model.embed_tokens.weight.data.copy_(small.model.embed_tokens.weight)
    init = _init_without_embedding(small)
    small.load_state_dict({k: v.float() for k, v in init.items()}, strict=False)
    big.load_state_dict({k: v.float() for k, v in init.items()}, strict=False)  # no zeroing
    ids = torch.randint(0, 96, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (big.logits(big.forward_padded(ids)) - small.logits(small.forward_padded(ids))).abs().max()
    assert diff > 1e-2


def test_without_grow_a_shallower_init_is_refused():
    small, big = _student(2, seed=1), _student(4, seed=2)
    with pytest.raises(RuntimeError, match="does not fit"):
        load_init(big, _init_without_embedding(small), grow=False, what="test")
