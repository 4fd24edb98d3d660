"""Draft model hyper-parameters read from a Hugging Face ``config.json`` (Llama / Mistral / Qwen2 / Qwen3)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

SUPPORTED = {"llama", "mistral", "qwen2", "qwen3"}


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict[str, Any]] = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False             # Qwen3: RMSNorm over head_dim on q and k before RoPE
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dir(cls, model_dir: str) -> "ModelConfig":
        with open(os.path.join(model_dir, "config.json")) as fh:
            hf = json.load(fh)
        cfg = cls.from_hf_dict(hf)
        cfg.name = hf.get("_name_or_path") or os.path.basename(os.path.normpath(model_dir))
        return cfg

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "ModelConfig":
        mt = hf.get("model_type", "llama")
        if mt not in SUPPORTED:
            raise ValueError(f"unsupported draft model_type {mt!r}; supported: {sorted(SUPPORTED)}")
        if hf.get("sliding_window") and hf.get("use_sliding_window", mt == "mistral"):
            raise ValueError("sliding-window attention is not supported by the draft runner")
        heads = hf["num_attention_heads"]
        # transformers >= 5 nests rope settings in "rope_parameters"; older configs use rope_theta + rope_scaling
        rope = dict(hf.get("rope_parameters") or {})
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind not in ("default", "llama3", "linear"):
                raise ValueError(f"unsupported rope scaling {kind!r} (supported: default, llama3, linear)")
            if kind == "default":
                scaling = None
            else:
                scaling = dict(scaling)
                scaling.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
        return cls(
            model_type=mt,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", mt == "qwen2")),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=(mt == "qwen3"),
            # reduced output head (sglang-ssd drafts): logits only over `ssd_head_vocab` token ids stored in
            # the checkpoint as `head_ids`; every other token has probability exactly 0 under the draft
            extra={"ssd_head_vocab": int(hf["ssd_head_vocab"])} if hf.get("ssd_head_vocab") else {},
        )

    @property
    def head_vocab(self) -> Optional[int]:
        return self.extra.get("ssd_head_vocab")

    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies (float32, [head_dim/2]), exactly as transformers computes them."""
        d = self.head_dim
        # inv_freq_i = theta^(-2i/d)
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        s = self.rope_scaling
        if s is None:
            return inv
        kind = s.get("rope_type", s.get("type"))
        if kind == "linear":
            return inv / s["factor"]
        # llama3: leave high frequencies alone, divide low ones by `factor`, blend in between
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_ctx = s["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / lo, old_ctx / hi
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / factor + smooth * out
        mid = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(mid, smoothed, out)
