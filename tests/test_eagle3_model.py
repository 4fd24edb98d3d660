"""EAGLE-3 draft heads (sglang_ssd/draft/eagle3.py): a synthetic checkpoint with the published key names,
shapes and config fields (SpecForge's save layout, which SGLang's llama_eagle3.py loads) loads, maps its
draft vocabulary through d2t, and computes what SpecForge's single-layer draft computes; bad checkpoints get
clear errors; saguaro's launch check takes them (tests/test_eagle3_draft.py and test_eagle3_e2e.py serve them)."""

import json
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from sglang_ssd.config import SaguaroConfigError, validate_draft_path
from sglang_ssd.draft.eagle3 import Eagle3Config, default_aux_layers, load_eagle3

V, D, DT, H, HKV, HD, FF, DV = 96, 32, 24, 4, 2, 8, 64, 40


def _config(**over):
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": D,
           "intermediate_size": FF, "num_attention_heads": H, "num_key_value_heads": HKV, "head_dim": HD,
           "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": V,
           "draft_vocab_size": DV, "target_hidden_size": DT, "tie_word_embeddings": False,
           "max_position_embeddings": 2048, "hidden_act": "silu"}
    cfg.update(over)
    return cfg


def _weights(seed=0, with_embed=False):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    hot = torch.sort(torch.randperm(V, generator=g)[:DV]).values  # the draft vocabulary's target ids
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[hot] = True
    w = {"fc.weight": r(D, 3 * DT), "norm.weight": 1 + r(D), "lm_head.weight": r(DV, D),
         "d2t": hot - torch.arange(DV), "t2d": t2d,
         "midlayer.hidden_norm.weight": 1 + r(D), "midlayer.input_layernorm.weight": 1 + r(D),
         "midlayer.post_attention_layernorm.weight": 1 + r(D),
         "midlayer.self_attn.q_proj.weight": r(H * HD, 2 * D), "midlayer.self_attn.k_proj.weight": r(HKV * HD, 2 * D),
         "midlayer.self_attn.v_proj.weight": r(HKV * HD, 2 * D), "midlayer.self_attn.o_proj.weight": r(D, H * HD),
         "midlayer.mlp.gate_proj.weight": r(FF, D), "midlayer.mlp.up_proj.weight": r(FF, D),
         "midlayer.mlp.down_proj.weight": r(D, FF)}
    if with_embed:
        w["embed_tokens.weight"] = r(V, D, scale=1.0)
    return w, hot


def _write(tmp_path, weights, cfg=None, name="eagle3"):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg or _config()))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(d / "model.safetensors"))
    return str(d)


def _rms(x, w, eps=1e-5):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _reference(w, emb_w, ids, aux):
    """SpecForge's LlamaForCausalLMEagle3 (one midlayer, ttt_length 1, causal), written out from its
    published forward: fc, then the decoder layer on [input_layernorm(emb) ; hidden_norm(h)], norm."""
    t = ids.shape[0]
    h = aux @ w["fc.weight"].t()
    residual = h
    x = torch.cat([_rms(emb_w[ids], w["midlayer.input_layernorm.weight"]),
                   _rms(h, w["midlayer.hidden_norm.weight"])], -1)
    q = (x @ w["midlayer.self_attn.q_proj.weight"].t()).view(t, H, HD).transpose(0, 1)
    k = (x @ w["midlayer.self_attn.k_proj.weight"].t()).view(t, HKV, HD).transpose(0, 1)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].t()).view(t, HKV, HD).transpose(0, 1)
    inv = 1.0 / (10000.0 ** (torch.arange(0, HD, 2).float() / HD))
    fr = torch.arange(t).float()[:, None] * inv[None]
    cos, sin = torch.cat([fr, fr], -1).cos(), torch.cat([fr, fr], -1).sin()

    def rope(y):
        y1, y2 = y[..., : HD // 2], y[..., HD // 2:]
        return y * cos + torch.cat([-y2, y1], -1) * sin

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(H // HKV, 0), v.repeat_interleave(H // HKV, 0)
    s = q @ k.transpose(1, 2) / math.sqrt(HD) + torch.full((t, t), float("-inf")).triu(1)
    o = (s.softmax(-1) @ v).transpose(0, 1).reshape(t, H * HD) @ w["midlayer.self_attn.o_proj.weight"].t()
    h = residual + o
    m = _rms(h, w["midlayer.post_attention_layernorm.weight"])
    mlp = (F.silu(m @ w["midlayer.mlp.gate_proj.weight"].t()) * (m @ w["midlayer.mlp.up_proj.weight"].t())) \
        @ w["midlayer.mlp.down_proj.weight"].t()
    out = h + mlp
    return _rms(out, w["norm.weight"]) @ w["lm_head.weight"].t(), out


def _causal(layer, q, k, v):
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       is_causal=True, enable_gqa=True)
    return o.transpose(0, 1)


@pytest.mark.parametrize("embed_in_checkpoint", [False, True])
def test_published_layout_loads_and_matches_specforge_math(tmp_path, embed_in_checkpoint):
    w, hot = _weights(with_embed=embed_in_checkpoint)
    target_embed = torch.randn(V, D)
    model = load_eagle3(_write(tmp_path, w), target_embed=None if embed_in_checkpoint else target_embed,
                        target_layers=30)
    assert model.cfg.aux_layer_ids == default_aux_layers(30) == [1, 14, 26]
    assert torch.equal(model.head_ids, hot)  # draft row i is target token i + d2t[i]
    emb_w = w["embed_tokens.weight"] if embed_in_checkpoint else target_embed
    ids, aux = torch.randint(0, V, (7,)), torch.randn(7, 3 * DT)
    with torch.no_grad():
        hidden, feature = model(ids, torch.arange(7), model.project(aux), _causal)
        logits = model.head_logits(hidden)
    ref_logits, ref_out = _reference(w, emb_w, ids, aux)
    assert torch.allclose(logits, ref_logits, atol=1e-4), (logits - ref_logits).abs().max()
    assert torch.allclose(feature, ref_out, atol=1e-5)  # the next step's feature: pre-norm output


def test_own_feature_feeds_the_next_step(tmp_path):
    """Ahead of the target, the draft's own (D-wide) output is the next position's feature: no fc."""
    w, _ = _weights(with_embed=True)
    model = load_eagle3(_write(tmp_path, w), target_layers=30)
    ids, aux = torch.randint(0, V, (5,)), torch.randn(5, 3 * DT)
    with torch.no_grad():
        _, f1 = model(ids, torch.arange(5), model.project(aux), _causal)
        h2, f2 = model(ids, torch.arange(5), f1, _causal)
    assert f2.shape == (5, D) and h2.shape == (5, D) and not torch.allclose(f1, f2)


def test_config_fields():
    c = Eagle3Config.from_hf_dict(_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [3, 9, 12, 20]},
                                          use_aux_norm=True, norm_output=True))
    assert c.aux_layer_ids == [3, 9, 12, 20] and c.num_aux == 4 and c.fc_norm and c.norm_output
    c = Eagle3Config.from_hf_dict(_config(target_hidden_size=None, draft_vocab_size=None))
    assert c.target_hidden_size == D and c.draft_vocab_size == V and c.aux_layer_ids is None  # until the target
    assert c.resolve_aux(24) == [1, 11, 20] and c.aux_layer_ids == [1, 11, 20]
    # a head whose config names its target's family (qwen3, qwen2) is still SGLang's bias-free Llama stack
    c = Eagle3Config.from_hf_dict(_config(model_type="qwen3", attention_bias=True))
    assert c.base.model_type == "llama" and not c.base.qk_norm and not c.base.attention_bias
    with pytest.raises(ValueError, match="needs eagle_aux_hidden_state_layer_ids"):
        Eagle3Config.from_hf_dict(_config(num_aux_hidden_states=2), target_layers=30)
    with pytest.raises(ValueError, match="not an EAGLE-3 config"):
        Eagle3Config.from_hf_dict(_config(architectures=["LlamaForCausalLM"]))
    with pytest.raises(ValueError, match="draft_vocab_size"):
        Eagle3Config.from_hf_dict(_config(draft_vocab_size=V + 1))


def test_aux_norm_and_legacy_names(tmp_path):
    """fc_norm via the legacy aux_norm_{low,mid,high} keys: each target feature normed before fc."""
    w, _ = _weights(with_embed=True)
    for i, n in enumerate(("low", "mid", "high")):
        w[f"aux_norm_{n}.weight"] = torch.full((DT,), 0.5 + i)
    model = load_eagle3(_write(tmp_path, w, _config(use_aux_norm=True)), target_layers=30)
    aux = torch.randn(3, 3 * DT)
    want = torch.cat([_rms(c, 0.5 + i) for i, c in enumerate(aux.chunk(3, -1))], -1) @ w["fc.weight"].t()
    assert torch.allclose(model.project(aux), want, atol=1e-5)


def test_bad_checkpoints_get_clear_errors(tmp_path, caplog):
    w, _ = _weights()
    with pytest.raises(ValueError, match="no embed_tokens"):
        load_eagle3(_write(tmp_path, w, name="a"))
    bad = dict(w, t2d=torch.zeros(V, dtype=torch.bool))  # SGLang ignores t2d: a warning, d2t rules
    with caplog.at_level(logging.WARNING, logger="sglang_ssd.draft.eagle3"):
        m = load_eagle3(_write(tmp_path, bad, name="b"), target_embed=torch.randn(V, D))
    assert "t2d disagrees" in caplog.text and torch.equal(m.head_ids, w["d2t"] + torch.arange(DV))
    dup = dict(w, d2t=torch.zeros(DV, dtype=torch.long) - torch.arange(DV))  # every row -> token 0
    with pytest.raises(ValueError, match="two rows to one token"):
        load_eagle3(_write(tmp_path, dup, name="c"), target_embed=torch.randn(V, D))
    short = {k: v for k, v in w.items() if k != "midlayer.mlp.down_proj.weight"}
    with pytest.raises(ValueError, match="missing"):
        load_eagle3(_write(tmp_path, short, name="d"), target_embed=torch.randn(V, D))
    with pytest.raises(ValueError, match=r"embedding \(96, 16\)"):
        load_eagle3(_write(tmp_path, w, name="e"), target_embed=torch.randn(V, 16))
    headless = {k: v for k, v in w.items() if k != "lm_head.weight"}  # draft vocabulary 40 < 96: no stand-in
    with pytest.raises(ValueError, match="no lm_head"):
        load_eagle3(_write(tmp_path, headless, name="f"), target_embed=torch.randn(V, D), target_head=torch.randn(V, D))


def test_launch_check_takes_eagle3_heads(tmp_path):
    """saguaro serves SpecForge's LlamaForCausalLMEagle3 heads; another EAGLE-3 architecture is named."""
    w, _ = _weights()
    validate_draft_path(_write(tmp_path, w))
    with pytest.raises(SaguaroConfigError, match="unsupported EAGLE-3 architecture"):
        validate_draft_path(_write(tmp_path, w, _config(architectures=["Qwen3ForCausalLMEagle3"]), name="q"))


def test_two_layers_and_tied_head(tmp_path):
    """A two-layer head (SGLang's later-layer keys, an unused input_layernorm among them) and a tied head
    (no lm_head, draft vocabulary = vocabulary): the second layer continues the residual stream; the
    head's rows are the embedding's."""
    w, _ = _weights(with_embed=True)
    g = torch.Generator().manual_seed(3)
    for k in [k for k in w if k.startswith("midlayer.")]:
        rest = k[len("midlayer."):]
        shape = list(w[k].shape)
        if rest.startswith("self_attn.") and rest[10] in "qkv":
            shape[1] = D  # later layers read D columns
        w["layers.1." + rest] = torch.randn(*shape, generator=g) * 0.2
    for k in ("lm_head.weight", "d2t", "t2d"):
        w.pop(k)
    cfg = _config(num_hidden_layers=2, tie_word_embeddings=True, draft_vocab_size=None)
    model = load_eagle3(_write(tmp_path, w, cfg), target_layers=30)
    assert torch.equal(model.lm_head.weight, w["embed_tokens.weight"]) and torch.equal(model.head_ids, torch.arange(V))
    ids, aux = torch.randint(0, V, (6,)), torch.randn(6, 3 * DT)
    with torch.no_grad():
        hidden, out = model(ids, torch.arange(6), model.project(aux), _causal)
        one_layer = model.layers[:1]
        model.layers = one_layer
        _, out1 = model(ids, torch.arange(6), model.project(aux), _causal)
    # layer 1 by hand: hidden_norm over the carried residual (out1 = mlp0 + residual0), D-wide q/k/v
    w1 = {k.replace("layers.1.", "midlayer."): v for k, v in w.items() if k.startswith("layers.1.")}
    x = _rms(out1, w1["midlayer.hidden_norm.weight"])
    t = 6
    q = (x @ w1["midlayer.self_attn.q_proj.weight"].t()).view(t, H, HD)
    k = (x @ w1["midlayer.self_attn.k_proj.weight"].t()).view(t, HKV, HD)
    v = (x @ w1["midlayer.self_attn.v_proj.weight"].t()).view(t, HKV, HD)
    cos, sin = _rope_tables(t)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    r = out1 + _causal(1, q, k, v).reshape(t, H * HD) @ w1["midlayer.self_attn.o_proj.weight"].t()
    m = _rms(r, w1["midlayer.post_attention_layernorm.weight"])
    want = r + (F.silu(m @ w1["midlayer.mlp.gate_proj.weight"].t()) * (m @ w1["midlayer.mlp.up_proj.weight"].t())) \
        @ w1["midlayer.mlp.down_proj.weight"].t()
    assert torch.allclose(out, want, atol=1e-5)
    assert torch.allclose(hidden, _rms(want, w["norm.weight"]), atol=1e-5)


def _rope_tables(t):
    inv = 1.0 / (10000.0 ** (torch.arange(0, HD, 2).float() / HD))
    fr = torch.arange(t).float()[:, None] * inv[None]
    return torch.cat([fr, fr], -1).cos(), torch.cat([fr, fr], -1).sin()


def _rope(y, cos, sin):  # y [T, H, d]
    y1, y2 = y[..., : HD // 2], y[..., HD // 2:]
    return y * cos[:, None] + torch.cat([-y2, y1], -1) * sin[:, None]
