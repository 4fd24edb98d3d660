"""A real SGLang HTTP server on CPU serves the converted SmolLM2 target; its greedy output equals
Hugging Face transformers' greedy output token for token."""

import pytest
import torch

from sglang_ssd.serving import SGLangServer
from tests.prompts import all_prompt_ids

pytestmark = pytest.mark.server
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def hf(target_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_path)
    model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    return tok, model


def test_sglang_greedy_equals_hf(target_path, hf, tmp_path):
    tok, model = hf
    prompts = all_prompt_ids(tok)[::3]  # 7 varied prompts
    expected = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            # explicit attention mask: without it HF infers padding from pad_token_id (= <|im_end|>,
            # which chat prompts contain) once eos_token_id is None, and masks real tokens
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=tok.eos_token_id)
            expected.append(out[0, len(ids):].tolist())
    with SGLangServer(target_path, ["--dtype", "float32"], cpu_core=0, log_path=str(tmp_path / "server.log")) as srv:
        outs = srv.generate(input_ids=prompts, sampling_params={
            "temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True})
        text = srv.generate(text="The capital of France is", sampling_params={"temperature": 0, "max_new_tokens": 8})
    got = [o["output_ids"] for o in outs]
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i}: sglang {g} != hf {e}"
    assert "Paris" in text["text"]
