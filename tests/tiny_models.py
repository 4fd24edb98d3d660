"""Tiny random Hugging Face checkpoints (Llama / Qwen3) for draft tests.

Written directly (config.json + model.safetensors with HF parameter names) so tests that only need a
checkpoint do not pay for importing transformers; test_draft_runner loads the very same directories
with transformers' LlamaForCausalLM / Qwen3ForCausalLM to check our runner against them.
Weights use a larger-than-usual std so logits are spread out (no near-ties that float noise could
flip between a batched and a sequential forward).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from typing import Any, Optional

import torch
from safetensors.torch import save_file

_ROOT: Optional[str] = None
_MADE: dict[tuple, str] = {}


def _root() -> str:
    global _ROOT
    if _ROOT is None:
        _ROOT = tempfile.mkdtemp(prefix="sglang-ssd-tiny-")
        atexit.register(shutil.rmtree, _ROOT, True)
    return _ROOT


def tiny_hf_config(kind: str = "llama", vocab_size: int = 96, **overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": ["Qwen3ForCausalLM" if kind == "qwen3" else "LlamaForCausalLM"],
        "model_type": kind, "vocab_size": vocab_size, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "hidden_act": "silu", "attention_bias": False, "bos_token_id": 0, "eos_token_id": 1,
        "rope_parameters": {"rope_theta": 1e6 if kind == "qwen3" else 10000.0, "rope_type": "default"},
    }
    cfg.update(overrides)
    return cfg


def random_state_dict(cfg: dict[str, Any], seed: int, std: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    h, hkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def w(*shape):
        return torch.randn(*shape, generator=g) * std

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    sd = {"model.embed_tokens.weight": w(v, d), "model.norm.weight": norm(d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd.update({p + "self_attn.q_proj.weight": w(h * hd, d), p + "self_attn.k_proj.weight": w(hkv * hd, d),
                   p + "self_attn.v_proj.weight": w(hkv * hd, d), p + "self_attn.o_proj.weight": w(d, h * hd),
                   p + "mlp.gate_proj.weight": w(f, d), p + "mlp.up_proj.weight": w(f, d),
                   p + "mlp.down_proj.weight": w(d, f), p + "input_layernorm.weight": norm(d),
                   p + "post_attention_layernorm.weight": norm(d)})
        if cfg["model_type"] == "qwen3":
            sd[p + "self_attn.q_norm.weight"] = norm(hd)
            sd[p + "self_attn.k_norm.weight"] = norm(hd)
    if not cfg["tie_word_embeddings"]:
        sd["lm_head.weight"] = w(v, d)
    return sd


def make_tiny_model(path: Optional[str] = None, kind: str = "llama", vocab_size: int = 96, seed: int = 0,
                    std: float = 0.3, **overrides: Any) -> str:
    """Build + save a random checkpoint; returns its directory (cached per argument set)."""
    key = (path, kind, vocab_size, seed, std, json.dumps(overrides, sort_keys=True))
    if key in _MADE and os.path.isdir(_MADE[key]):
        return _MADE[key]
    cfg = tiny_hf_config(kind, vocab_size, **overrides)
    out = path or os.path.join(_root(), f"{kind}-v{vocab_size}-s{seed}-{len(_MADE)}")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=1)
    save_file(random_state_dict(cfg, seed, std), os.path.join(out, "model.safetensors"),
              metadata={"format": "pt"})
    _MADE[key] = out
    return out


def make_reduced_head_model(head_ids: list[int], vocab_size: int = 96, seed: int = 0, std: float = 0.3) -> str:
    """A random draft checkpoint with an sglang-ssd reduced head: lm_head rows for `head_ids` only (in the
    given order, which need not be sorted), config `ssd_head_vocab`; every other id has probability 0."""
    key = ("reduced", tuple(head_ids), vocab_size, seed, std)
    if key in _MADE and os.path.isdir(_MADE[key]):
        return _MADE[key]
    cfg = tiny_hf_config("llama", vocab_size, ssd_head_vocab=len(head_ids))
    sd = random_state_dict(cfg, seed, std)
    sd["lm_head.weight"] = sd["lm_head.weight"][: len(head_ids)].clone()
    sd["head_ids"] = torch.as_tensor(head_ids, dtype=torch.long)
    out = os.path.join(_root(), f"reduced-v{vocab_size}-h{len(head_ids)}-s{seed}-{len(_MADE)}")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=1)
    save_file(sd, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    _MADE[key] = out
    return out


def load_hf(path: str):
    """The same checkpoint through transformers (eager attention, fp32) -- the reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


# --- sequential references (one token at a time, fresh KV) ------------------------------------------
def next_logits(runner, context: list[int]) -> torch.Tensor:
    """float32 [V] logits of the token after `context`, from a fresh cache."""
    from sglang_ssd.draft.runner import ForwardItem

    return runner.forward([ForwardItem.extend(runner.new_kv(), list(context), 0)])[0][0]


def greedy_reference(runner, context: list[int], n: int) -> list[int]:
    """Plain sequential greedy decode of n tokens after `context`: prefill, then 1 token per forward."""
    from sglang_ssd.draft.runner import ForwardItem

    kv = runner.new_kv()
    logits = runner.forward([ForwardItem.extend(kv, list(context), 0)])[0][0]
    out = []
    for i in range(n):
        out.append(int(logits.argmax()))
        if i + 1 < n:
            logits = runner.forward([ForwardItem.extend(kv, [out[-1]], len(context) + i)])[0][0]
    return out


def _eagle3_files(out_dir: str, w: dict, d: int, heads: int, kv: int, hd: int, ff: int, vocab: int,
                  draft_vocab: int, target_hidden: int, rms_eps: float = 1e-5, rope_theta: float = 10000.0,
                  max_pos: int = 8192) -> str:
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": d,
           "intermediate_size": ff, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
           "num_hidden_layers": 1, "rms_norm_eps": rms_eps, "rope_theta": rope_theta, "vocab_size": vocab,
           "draft_vocab_size": draft_vocab, "target_hidden_size": target_hidden, "tie_word_embeddings": False,
           "hidden_act": "silu", "max_position_embeddings": max_pos,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(out_dir, "model.safetensors"))
    return out_dir


def _eagle3_weights(g, d, heads, kv, hd, ff, vocab, hot, target_hidden, std, lm_head):
    def r(*shape):
        return torch.randn(*shape, generator=g) * std

    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[hot] = True
    return {"fc.weight": r(d, 3 * target_hidden), "norm.weight": torch.ones(d), "lm_head.weight": lm_head,
            "d2t": hot - torch.arange(len(hot)), "t2d": t2d,
            "midlayer.hidden_norm.weight": torch.ones(d), "midlayer.input_layernorm.weight": torch.ones(d),
            "midlayer.post_attention_layernorm.weight": torch.ones(d),
            "midlayer.self_attn.q_proj.weight": r(heads * hd, 2 * d), "midlayer.self_attn.k_proj.weight": r(kv * hd, 2 * d),
            "midlayer.self_attn.v_proj.weight": r(kv * hd, 2 * d), "midlayer.self_attn.o_proj.weight": r(d, heads * hd),
            "midlayer.mlp.gate_proj.weight": r(ff, d), "midlayer.mlp.up_proj.weight": r(ff, d),
            "midlayer.mlp.down_proj.weight": r(d, ff)}


def make_tiny_eagle3(vocab_size: int = 8, seed: int = 0, std: float = 0.3, target_hidden: int = 12) -> str:
    """A tiny random EAGLE-3 head (own embedding, full draft vocabulary, features of 3 x target_hidden)."""
    g = torch.Generator().manual_seed(seed)
    d, heads, kv, hd, ff = 16, 2, 1, 8, 32
    w = _eagle3_weights(g, d, heads, kv, hd, ff, vocab_size, torch.arange(vocab_size), target_hidden, std,
                        torch.randn(vocab_size, d, generator=g))
    w["embed_tokens.weight"] = torch.randn(vocab_size, d, generator=g)
    return _eagle3_files(os.path.join(_root(), f"eagle3-v{vocab_size}-s{seed}"), w, d, heads, kv, hd, ff,
                         vocab_size, vocab_size, target_hidden)


def make_eagle3_head(target_dir: str, out_dir: str, seed: int = 0, draft_vocab: int = 8192,
                     std: float = 0.05) -> str:
    """A random EAGLE-3 head for a real target in SpecForge's published layout: one ``midlayer``, ``fc``
    over 3 of the target's layers, ``d2t`` / ``t2d`` over `draft_vocab` token ids, no embedding (the
    target's is used, as SGLang does).  Its ``lm_head`` rows are the target's embedding rows of its
    draft vocabulary (so proposals are real tokens, not noise); it is untrained, so its acceptance is
    low: serving tests check exactness and the feature plumbing, not its speed."""
    from safetensors import safe_open

    with open(os.path.join(target_dir, "config.json")) as fh:
        t = json.load(fh)
    d, heads, kv = t["hidden_size"], t["num_attention_heads"], t["num_key_value_heads"]
    hd, ff, vocab = t.get("head_dim") or d // heads, t["intermediate_size"], t["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    hot = torch.sort(torch.randperm(vocab, generator=g)[:draft_vocab]).values
    with safe_open(os.path.join(target_dir, "model.safetensors"), framework="pt") as sf:
        embed = sf.get_tensor("model.embed_tokens.weight").float()
    w = _eagle3_weights(g, d, heads, kv, hd, ff, vocab, hot, d, std, embed[hot].clone())
    n = t["num_hidden_layers"]
    out = _eagle3_files(out_dir, w, d, heads, kv, hd, ff, vocab, draft_vocab, d, t.get("rms_norm_eps", 1e-5),
                        t.get("rope_theta", 10000.0), t.get("max_position_embeddings", 8192))
    with open(os.path.join(out, "config.json")) as fh:  # SGLang's default capture points, as SpecForge writes them
        cfg = json.load(fh)
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, n // 2 - 1, n - 4]}
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    return out
