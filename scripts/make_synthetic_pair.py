"""Write a synthetic Llama-shaped target and two drafts (HF dirs: config.json + model.safetensors).

Why synthetic: the GPU check (scripts/gpu_check.sh) must run offline in minutes with CONTROLLED
acceptance, which real checkpoints do not give.  All three share one seed:
  target/        random init (std 0.02), the model SGLang serves
  draft_equal/   the same weights: every draft token is accepted at T = 0 (acceptance 1)
  draft_noisy/   the same weights plus Gaussian noise on every MLP down-projection: the draft
                 disagrees with the target on some tokens (acceptance < 1, measured, not set)
The vocabulary is the prepared SmolLM2 tokenizer's (its tokenizer files are copied when
$SGLANG_SSD_MODELS holds the prepared target); without it the vocab is 49152 and no tokenizer is
written -- the benchmark sends token ids with --skip-tokenizer-init, so none is needed.

python scripts/make_synthetic_pair.py OUT [--hidden 1024 --layers 8 --noise 0.5]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from sglang_ssd.paths import target_path  # noqa: E402

logger = logging.getLogger("make_synthetic_pair")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "generation_config.json")


def llama_config(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": hidden * 4, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": hidden // heads,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}


def random_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd, h, hkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = lambda *s: (torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16)
    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)
    sd = {"model.embed_tokens.weight": w(v, d), "model.norm.weight": ones(d), "lm_head.weight": w(v, d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd.update({p + "self_attn.q_proj.weight": w(h * hd, d), p + "self_attn.k_proj.weight": w(hkv * hd, d),
                   p + "self_attn.v_proj.weight": w(hkv * hd, d), p + "self_attn.o_proj.weight": w(d, h * hd),
                   p + "mlp.gate_proj.weight": w(f, d), p + "mlp.up_proj.weight": w(f, d),
                   p + "mlp.down_proj.weight": w(d, f), p + "input_layernorm.weight": ones(d),
                   p + "post_attention_layernorm.weight": ones(d)})
    return sd


def write(out: str, cfg: dict, sd: dict, tok_dir: str | None) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=1)
    save_file(sd, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    for name in TOKENIZER_FILES if tok_dir else ():
        src = os.path.join(tok_dir, name)
        if os.path.exists(src):
            shutil.copy(src, out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--noise", type=float, default=0.5, help="noise std relative to the weights' std (0.02)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s: %(message)s")
    tok_dir = target_path() if os.path.exists(os.path.join(target_path(), "tokenizer.json")) else None
    vocab = 49152
    if tok_dir:
        vocab = json.load(open(os.path.join(tok_dir, "config.json"))).get("vocab_size", vocab)
    cfg = llama_config(vocab, args.hidden, args.layers, args.heads, args.kv_heads)
    sd = random_weights(cfg, args.seed)
    write(os.path.join(args.out, "target"), cfg, sd, tok_dir)
    write(os.path.join(args.out, "draft_equal"), cfg, sd, tok_dir)
    g = torch.Generator().manual_seed(args.seed + 1)
    noisy = {k: (t.float() + torch.randn(t.shape, generator=g) * 0.02 * args.noise).to(t.dtype)
             if k.endswith("mlp.down_proj.weight") else t for k, t in sd.items()}
    write(os.path.join(args.out, "draft_noisy"), cfg, noisy, tok_dir)
    logger.info("wrote %s/{target,draft_equal,draft_noisy}: %d layers, hidden %d, vocab %d, tokenizer %s",
                args.out, args.layers, args.hidden, vocab, tok_dir or "none (use --skip-tokenizer-init)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
