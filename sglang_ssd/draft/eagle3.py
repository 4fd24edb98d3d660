"""EAGLE-3 draft heads in the published layout (SpecForge checkpoints, SGLang's ``llama_eagle3.py``).

An EAGLE-3 draft is not a language model of its own: every step it reads the embedding of the token just
committed and a *feature* of the position before it, and predicts the next token over a reduced draft
vocabulary.  The feature is either the target's (three residual-stream snapshots of its layers,
concatenated, projected by ``fc``) or, further ahead than the target has run, the draft's own previous
output (pre-norm, already D wide).  Per position t (token x_t, feature h_{t-1}):

    g      = fc(concat(aux_1, aux_2, aux_3))          target features [T, n_aux * D_t] -> [T, D]  (project)
    x      = concat(input_layernorm(embed(x_t)), hidden_norm(g))                     [T, 2D]
    r      = g + o_proj(attn(q/k/v_proj(x)))           layer 0's q/k/v read 2D columns
    out    = r + mlp(post_attention_layernorm(r))     (later layers, if any, as SGLang: hidden_norm
                                                        over the carried residual, D-wide q/k/v;
                                                        published heads have one layer, and only
                                                        that case is tested against SpecForge)
    logits = lm_head(norm(out))  over draft_vocab rows; row i is target token d2t[i] + i
    next feature = out (pre-norm; ``norm_output`` in the config: norm(out))

Checkpoint keys, as SpecForge writes them and SGLang reads them: ``midlayer.*`` (= layer 0; or
``layers.N.*``), ``fc.weight`` [D, n_aux * D_t], ``norm.weight``, ``lm_head.weight`` [draft_vocab, D],
``d2t`` [draft_vocab] (target id minus draft id), ``t2d`` [vocab] (bool: target token has a draft row),
optional ``embed_tokens.weight`` (SpecForge leaves it out: the target's embedding is used, as SGLang does),
optional ``fc_norm.N`` / ``aux_norm_{low,mid,high}`` and ``input_norm``.  Config: a Llama config with
``architectures`` naming ``LlamaForCausalLMEagle3``, ``draft_vocab_size``, optional ``target_hidden_size``,
``num_aux_hidden_states`` or ``eagle_config.eagle_aux_hidden_state_layer_ids`` (default 3 features of the
target's layers 1, L/2 - 1, L - 4, i.e. SGLang's capture points 2, L/2, L - 3), ``norm_before_fc``,
``fc_norm`` / ``use_aux_norm``, ``norm_output``.

The draft vocabulary is the same idea as sglang-ssd's reduced head (``head_ids``): q is exactly 0 off it,
so verification against q stays exact.  This module is the model and its loaders (``load_draft`` picks the
kind from the checkpoint's config); the runner drives it with the target's features (features.py).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from sglang_ssd.config import is_eagle3_config
from sglang_ssd.draft.config import ModelConfig
from sglang_ssd.draft.model import (MLP, AttnFn, Attention, CausalLM, RMSNorm, assign_state, load_model,
                                    read_checkpoint, rope_cos_sin)

ARCH = "LlamaForCausalLMEagle3"
logger = logging.getLogger(__name__)
LEGACY_NAMES = {"midlayer.": "layers.0.", "aux_norm_low": "fc_norm.0", "aux_norm_mid": "fc_norm.1",
                "aux_norm_high": "fc_norm.2"}


@dataclass
class Eagle3Config:
    base: ModelConfig            # the decoder's own shape (hidden_size D, heads, rope, eps, layers)
    draft_vocab_size: int
    target_hidden_size: int      # D_t, width of each target feature
    num_aux: int                 # target features concatenated per position
    aux_layer_ids: Optional[list[int]]  # target layers whose outputs they are (HF hidden_states[id + 1]);
    #                                     None: the default for the target, known once it is (resolve_aux)
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    fc_bias: bool = False

    def resolve_aux(self, target_layers: int) -> list[int]:
        if self.aux_layer_ids is None:
            if self.num_aux != 3:
                raise ValueError(f"num_aux_hidden_states {self.num_aux} needs eagle_aux_hidden_state_layer_ids")
            self.aux_layer_ids = default_aux_layers(target_layers)
        return self.aux_layer_ids

    @classmethod
    def from_hf_dict(cls, hf: dict, target_layers: Optional[int] = None) -> "Eagle3Config":
        if not is_eagle3_config(hf):
            raise ValueError(f"not an EAGLE-3 config: architectures {hf.get('architectures')!r} (want {ARCH})")
        # SGLang builds every EAGLE-3 head as a Llama layer stack without q/k/v bias or q/k norm, whatever
        # model_type the checkpoint names (its target's, often)
        base = ModelConfig.from_hf_dict({**hf, "model_type": "llama", "attention_bias": False})
        eagle = hf.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        n_aux = int(hf.get("num_aux_hidden_states") or (len(ids) if ids else 3))
        if ids and len(ids) != n_aux:
            raise ValueError(f"num_aux_hidden_states {n_aux} != {len(ids)} eagle_aux_hidden_state_layer_ids")
        dv = hf.get("draft_vocab_size") or base.vocab_size
        if not 0 < dv <= base.vocab_size:
            raise ValueError(f"draft_vocab_size {dv} must be in [1, vocab_size {base.vocab_size}]")
        cfg = cls(base=base, draft_vocab_size=int(dv),
                  target_hidden_size=int(hf.get("target_hidden_size") or base.hidden_size), num_aux=n_aux,
                  aux_layer_ids=[int(i) for i in ids] if ids else None,
                  norm_before_fc=bool(eagle.get("norm_before_fc", hf.get("norm_before_fc", False))),
                  fc_norm=bool(hf.get("fc_norm") or hf.get("use_aux_norm", False)),
                  norm_output=bool(hf.get("norm_output", False)), fc_bias=bool(hf.get("bias", False)))
        if target_layers is not None:
            cfg.resolve_aux(target_layers)
        return cfg


def default_aux_layers(target_layers: int) -> list[int]:
    """SGLang's default capture points [2, L/2, L-3] (inputs of those layers) as layer ids (their outputs)."""
    return [1, target_layers // 2 - 1, target_layers - 4]


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.first = layer == 0
        self.self_attn = Attention(cfg, layer)
        if self.first:  # layer 0 reads [embedding ; feature]: q/k/v take 2D columns
            a, d_in = self.self_attn, 2 * cfg.hidden_size
            a.q_proj = nn.Linear(d_in, a.h * a.d, bias=False)
            a.k_proj = nn.Linear(d_in, a.hkv * a.d, bias=False)
            a.v_proj = nn.Linear(d_in, a.hkv * a.d, bias=False)
        self.mlp = MLP(cfg)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.first:  # (SGLang gives later layers one too, unused: their checkpoint keys are dropped)
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, emb, h, residual, cos, sin, attn: AttnFn):
        if self.first:  # the feature is the residual stream; the attention input is [norm(emb) ; norm(h)]
            residual = h
            x = torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], dim=-1)
        else:           # SGLang's fused add-norm: the previous MLP output joins the residual
            residual = h + residual
            x = self.hidden_norm(residual)
        residual = residual + self.self_attn(x, cos, sin, attn)
        return self.mlp(self.post_attention_layernorm(residual)), residual


class Eagle3Draft(nn.Module):
    head_linear = staticmethod(F.linear)  # the head's product (cpu_linear.route_linears: packed weights)

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.cfg = c = cfg
        b = c.base
        self.embed_tokens = nn.Embedding(b.vocab_size, b.hidden_size)
        feat = c.target_hidden_size * c.num_aux
        self.fc = nn.Linear(feat, b.hidden_size, bias=c.fc_bias)
        self.input_norm = RMSNorm(feat, b.rms_norm_eps) if c.norm_before_fc else None
        self.fc_norm = (nn.ModuleList(RMSNorm(c.target_hidden_size, b.rms_norm_eps) for _ in range(c.num_aux))
                        if c.fc_norm else None)
        self.layers = nn.ModuleList(Eagle3Layer(b, i) for i in range(b.num_layers))
        self.norm = RMSNorm(b.hidden_size, b.rms_norm_eps)
        self.lm_head = nn.Linear(b.hidden_size, c.draft_vocab_size, bias=False)  # tied: the embedding's rows
        self.register_buffer("head_ids", torch.arange(c.draft_vocab_size))  # target id of each draft row
        self.register_buffer("inv_freq", b.inv_freq(), persistent=False)

    def project(self, target_features: torch.Tensor) -> torch.Tensor:
        """The target's concatenated aux hidden states [T, n_aux * D_t] -> draft features [T, D]."""
        h = target_features
        if self.input_norm is not None:
            h = self.input_norm(h)
        if self.fc_norm is not None:
            h = torch.cat([n(x) for n, x in zip(self.fc_norm, h.chunk(self.cfg.num_aux, dim=-1))], dim=-1)
        return self.fc(h)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor,
                attn: AttnFn) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions [T], features [T, D] (``project``-ed target features or the draft's own)
        -> (final-norm hidden [T, D] for ``head_logits``, the next step's feature [T, D])."""
        emb = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.inv_freq, emb.dtype)
        h, residual = features, None
        for layer in self.layers:
            h, residual = layer(emb, h, residual, cos, sin, attn)
        out = h + residual
        normed = self.norm(out)
        return normed, (normed if self.cfg.norm_output else out)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., D] -> float32 logits over the draft vocabulary's rows (token ids: ``head_ids``)."""
        return self.head_linear(hidden, self.lm_head.weight).float()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, D] -> float32 logits [R, V]: -inf (probability 0) at every token without a draft row."""
        sub = self.head_logits(hidden)
        out = sub.new_full((sub.shape[0], self.cfg.base.vocab_size), float("-inf"))
        return out.index_copy_(1, self.head_ids, sub)


def _rename(name: str) -> str:
    name = name[len("model."):] if name.startswith("model.") else name
    for old, new in LEGACY_NAMES.items():
        name = name.replace(old, new)
    return name


def load_eagle3(model_dir: str, target_embed: Optional[torch.Tensor] = None, target_layers: Optional[int] = None,
                target_head: Optional[torch.Tensor] = None, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> Eagle3Draft:
    """Load an EAGLE-3 checkpoint directory.  ``target_embed`` [V, D]: the target's input embedding, used
    when the checkpoint has none (SpecForge's usual case); ``target_head`` [V, D]: the target's output
    head, for a checkpoint with no lm_head and no draft vocabulary (SGLang's load_lm_head_from_target);
    ``target_layers``: the target's layer count, for the default feature layers."""
    with open(os.path.join(model_dir, "config.json")) as fh:
        cfg = Eagle3Config.from_hf_dict(json.load(fh), target_layers)
    state = {_rename(k): v for k, v in read_checkpoint(model_dir).items()}
    for i in range(1, cfg.base.num_layers):  # present in SGLang's later layers, never used
        state.pop(f"layers.{i}.input_layernorm.weight", None)
    d2t, t2d = state.pop("d2t", None), state.pop("t2d", None)
    if "embed_tokens.weight" not in state:
        if target_embed is None:
            raise ValueError(f"{model_dir} has no embed_tokens.weight: pass the target's embedding")
        state["embed_tokens.weight"] = target_embed
    want = tuple(state["embed_tokens.weight"].shape)
    if want != (cfg.base.vocab_size, cfg.base.hidden_size):
        raise ValueError(f"embedding {want} != (vocab_size, hidden_size) "
                         f"({cfg.base.vocab_size}, {cfg.base.hidden_size})")
    if "lm_head.weight" not in state:
        full = cfg.draft_vocab_size == cfg.base.vocab_size
        if cfg.base.tie_word_embeddings and full:
            state["lm_head.weight"] = state["embed_tokens.weight"]
        elif target_head is not None and full:
            state["lm_head.weight"] = target_head
        else:
            raise ValueError(f"{model_dir} has no lm_head.weight: a tied or the target's head needs "
                             f"draft_vocab_size = vocab_size (pass target_head)")
    # draft row i predicts target token i + d2t[i] (SGLang's hot_token_id); no d2t = the identity map
    ids = torch.arange(cfg.draft_vocab_size)
    if d2t is not None:
        if tuple(d2t.shape) != (cfg.draft_vocab_size,):
            raise ValueError(f"d2t has shape {tuple(d2t.shape)}, want ({cfg.draft_vocab_size},)")
        ids = ids + d2t.long()
    elif cfg.draft_vocab_size != cfg.base.vocab_size:
        raise ValueError(f"draft_vocab_size {cfg.draft_vocab_size} < vocab_size needs d2t")
    if ids.min() < 0 or ids.max() >= cfg.base.vocab_size or len(set(ids.tolist())) != len(ids):
        raise ValueError("d2t maps draft rows outside the vocabulary or two rows to one token")
    if t2d is not None and (t2d.numel() != cfg.base.vocab_size or not bool(t2d.bool()[ids].all())
                            or int(t2d.bool().sum()) != cfg.draft_vocab_size):
        # SGLang reads only d2t, and q is built from it alone, so this cannot break exactness: say so
        logger.warning("%s: t2d disagrees with d2t (each draft row's token marked, and only those); "
                       "using d2t, as SGLang does", model_dir)
    state["head_ids"] = ids
    model = assign_state(lambda: Eagle3Draft(cfg), state, f"{model_dir} (EAGLE-3 layout)")
    model.inv_freq = cfg.base.inv_freq()  # non-persistent buffer: recompute off the meta device
    model = model.to(device=device, dtype=dtype)
    model.head_ids = ids.to(device)
    model.inv_freq = cfg.base.inv_freq().to(device)  # RoPE frequencies stay float32
    return model.eval().requires_grad_(False)


def _target_tensor(target_dir: str, name: str) -> Optional[torch.Tensor]:
    """One tensor of the target's checkpoint (safetensors, read lazily: a large target is not loaded)."""
    from safetensors import safe_open

    index = os.path.join(target_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as fh:
            files = [json.load(fh)["weight_map"].get(name)]
    else:
        files = sorted(f for f in os.listdir(target_dir) if f.endswith(".safetensors"))
    for f in files:
        if f is None:
            continue
        with safe_open(os.path.join(target_dir, f), framework="pt") as sf:
            if name in sf.keys():
                return sf.get_tensor(name)
    return None


def load_draft(model_dir: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               target_dir: Optional[str] = None) -> "CausalLM | Eagle3Draft":
    """A draft checkpoint of either kind, chosen by its config: an EAGLE-3 head (reads the target's
    embedding and layer count from ``target_dir`` when the checkpoint leaves them out) or a causal LM."""
    with open(os.path.join(model_dir, "config.json")) as fh:
        hf = json.load(fh)
    if not is_eagle3_config(hf):
        return load_model(model_dir, device, dtype)
    embed = layers = None
    if target_dir is not None:
        with open(os.path.join(target_dir, "config.json")) as fh:
            layers = int(json.load(fh)["num_hidden_layers"])
        embed = _target_tensor(target_dir, "model.embed_tokens.weight")
    model = load_eagle3(model_dir, target_embed=embed, target_layers=layers, device=device, dtype=dtype)
    if model.cfg.aux_layer_ids is None:
        raise ValueError(f"{model_dir}: the EAGLE-3 config names no feature layers; pass the target's "
                         "checkpoint (--target-model) for the default ones")
    logger.info("loaded EAGLE-3 head %s: %d layer(s), draft vocab %d, target features of layers %s",
                model_dir, model.cfg.base.num_layers, model.cfg.draft_vocab_size, model.cfg.aux_layer_ids)
    return model
