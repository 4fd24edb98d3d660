"""A minimal Llama-family causal LM (Llama, Mistral, Qwen2, Qwen3) in plain torch.

Token-flat layout: every forward takes T tokens of possibly many requests, ``positions`` [T] for
RoPE, and an attention callable that owns KV caching and masking (see attention.py).  Parameter
names mirror Hugging Face so a safetensors checkpoint loads with ``load_state_dict``.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from sglang_ssd.draft.config import ModelConfig

logger = logging.getLogger(__name__)

# attn(layer, q [T, H, hd], k [T, Hkv, hd], v [T, Hkv, hd]) -> [T, H, hd]
AttnFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # y = w * x / sqrt(mean(x^2) + eps), statistics in float32 (as transformers does)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> (cos, sin) [T, head_dim]: angle[t, i] = pos_t * inv_freq_i in float32, duplicated
    for the two halves (rotate_half's layout)."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, H, d]; cos/sin [T, d] -> rotate pairs (i, i + d/2) by angle pos * inv_freq_i
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.h, self.hkv, self.d = layer, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.h * self.d, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.hkv * self.d, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.hkv * self.d, bias=bias)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x, cos, sin, attn: AttnFn):
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.h, self.d)
        k = self.k_proj(x).view(t, self.hkv, self.d)
        v = self.v_proj(x).view(t, self.hkv, self.d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = attn(self.layer, q, k, v)  # [T, H, d]
        return self.o_proj(o.reshape(t, self.h * self.d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        b = cfg.mlp_bias
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=b)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=b)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=b)

    def forward(self, x):
        # SwiGLU: down(silu(gate x) * up x)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, attn: AttnFn):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    head_linear = staticmethod(F.linear)  # the head's product (cpu_linear.route_linears: packed weights)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        hv = cfg.head_vocab
        if hv:  # reduced head: rows for the token ids in head_ids only (q = 0 elsewhere, so verify stays exact)
            self.lm_head = nn.Linear(cfg.hidden_size, hv, bias=False)
            self.register_buffer("head_ids", torch.zeros(hv, dtype=torch.long))
        else:
            self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            self.head_ids = None
        self.register_buffer("inv_freq", cfg.inv_freq(), persistent=False)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.inv_freq, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttnFn) -> torch.Tensor:
        """input_ids, positions [T] -> final-norm hidden states [T, D]."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, attn)
        return self.model.norm(x)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] -> float32 logits over the head's own rows (V, or head_vocab for a reduced head)."""
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.head_linear(hidden, w).float()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, D] -> float32 logits [R, V]; a reduced head gives -inf (probability 0) off its subset."""
        sub = self.head_logits(hidden)
        if self.head_ids is None:
            return sub
        out = sub.new_full((sub.shape[0], self.cfg.vocab_size), float("-inf"))
        return out.index_copy_(1, self.head_ids, sub)

    def forward_padded(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Plain causal forward of right-padded sequences input_ids [B, L] -> hidden [B, L, D] (training, eval)."""
        b, n = input_ids.shape

        def attn(layer, q, k, v):  # token-flat [B*L, H, d] -> per-sequence causal SDPA
            q, k, v = (x.view(b, n, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return o.transpose(1, 2).reshape(b * n, o.shape[1], o.shape[3])

        pos = torch.arange(n, device=input_ids.device).repeat(b)
        return self(input_ids.reshape(-1), pos, attn).view(b, n, -1)


def read_checkpoint(model_dir: str) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory on the CPU: its *.safetensors (the index's shards when there is
    one), else its pytorch_model*.bin read weights-only (no pickled code runs).  RoPE caches are dropped."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as fh:
            files = sorted({os.path.join(model_dir, f) for f in json.load(fh)["weight_map"].values()})
    state: dict[str, torch.Tensor] = {}
    if files:
        for f in files:
            state.update(load_file(f, device="cpu"))
    else:
        bins = sorted(glob.glob(os.path.join(model_dir, "pytorch_model*.bin")))
        if not bins:
            raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin in {model_dir}")
        for f in bins:
            state.update(torch.load(f, map_location="cpu", weights_only=True))
    return {k: v for k, v in state.items() if "rotary_emb" not in k}


def assign_state(build: Callable[[], nn.Module], state: dict[str, torch.Tensor], what: str) -> nn.Module:
    """Build a module on the meta device (no random init) and take the checkpoint's tensors as its own;
    a key missing or left over is an error naming a few of them."""
    with torch.device("meta"):
        model = build()
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"checkpoint {what} does not match: missing {missing[:8]}, unexpected {unexpected[:8]}")
    return model


def load_model(model_dir: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> CausalLM:
    """Build the model on the meta device and assign the checkpoint tensors (no random init)."""
    cfg = ModelConfig.from_dir(model_dir)
    state = read_checkpoint(model_dir)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model = assign_state(lambda: CausalLM(cfg), state, f"{model_dir} ({cfg.model_type} layout)")
    model.inv_freq = cfg.inv_freq()  # non-persistent buffer: recompute off the meta device
    model = model.to(device=device, dtype=dtype)
    model.inv_freq = cfg.inv_freq().to(device)  # keep RoPE frequencies in float32
    model.eval().requires_grad_(False)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("loaded %s (%s, %d layers, %.1fM params) on %s as %s", cfg.name, cfg.model_type,
                cfg.num_layers, n_params / 1e6, device, dtype)
    return model
