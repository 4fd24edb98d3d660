"""Training-time test (EAGLE-3) for an ``Eagle3Draft``: the forward that training and its evaluation share.

At inference the head drafts several tokens past the target's last feature, each from its own previous
output (eagle3.py), and in SSD a cached speculation starts up to K + 1 slots past it.  Training-time test
trains exactly that: step s = 0, 1, .., S-1 over a batch of teacher-forced sequences, where at step s slot t
stands for position t + s (token x_{t+s}) and its feature is

    s = 0:  fc(target aux states at t - 1)                  (zeros at slot 0, as features.gather gives)
    s > 0:  the head's own output at slot t of step s - 1    (the draft's output at position t + s - 1)

and its query attends to the step-0 keys of slots <= t (positions 0..t, written from target features) plus
the keys of steps 1..s at slot t itself (positions t+1..t+s, written from its own) -- the KV a draft has
when it proposes the (s+1)-th token past its last target feature.  RoPE uses the true position t + s.
Step s's logits at slot t predict x_{t+s+1}; the label is the target's distribution there.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from sglang_ssd.draft.eagle3 import Eagle3Draft
from sglang_ssd.draft.model import apply_rope, rope_cos_sin


def ttt_forward(model: Eagle3Draft, tokens: torch.Tensor, target_feats: torch.Tensor, valid: torch.Tensor,
                steps: int) -> list[torch.Tensor]:
    """tokens [B, T] (right-padded), target_feats [B, T, n_aux * D_t] (row t = target aux states AT t),
    valid [B, T] bool -> per step s the final-norm hidden [B, T, D] of slot t (predicting x_{t+s+1}).
    One-layer heads only (the published layout)."""
    assert len(model.layers) == 1, "training-time test is written for the published one-layer head"
    layer, attn = model.layers[0], model.layers[0].self_attn
    b, t = tokens.shape
    h_, hkv, d = attn.h, attn.hkv, attn.d
    g = model.project(target_feats)                                   # [B, T, D]
    feat = torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], dim=1)  # slot t reads position t - 1
    slots = torch.arange(t, device=tokens.device)
    causal = (slots[None, :] <= slots[:, None])[None, None] & valid[:, None, None, :]  # [B, 1, T, T]
    k0 = v0 = None
    diag_k: list[torch.Tensor] = []
    diag_v: list[torch.Tensor] = []
    outs = []
    scale = 1.0 / math.sqrt(d)
    for s in range(steps):
        ids = torch.cat([tokens[:, s:], tokens.new_zeros(b, min(s, t))], dim=1)[:, :t]  # x_{t+s}
        emb = model.embed_tokens(ids)
        cos, sin = rope_cos_sin(slots + s, model.inv_freq, emb.dtype)
        x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(feat)], dim=-1)
        q = apply_rope(attn.q_proj(x).view(b, t, h_, d), cos, sin)
        k = apply_rope(attn.k_proj(x).view(b, t, hkv, d), cos, sin)
        v = attn.v_proj(x).view(b, t, hkv, d)  # (apply_rope broadcasts over the batch dim)
        rep = h_ // hkv
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)  # GQA -> [B, T, H, d]
        qh = q.transpose(1, 2)                                          # [B, H, T, d]
        if s == 0:
            k0, v0 = k.transpose(1, 2), v.transpose(1, 2)
        else:
            diag_k.append(k.transpose(1, 2))
            diag_v.append(v.transpose(1, 2))
        sc = (qh @ k0.transpose(-1, -2)) * scale                        # [B, H, T, T]
        sc = sc.masked_fill(~causal, float("-inf"))
        extra = [(qh * kk).sum(-1, keepdim=True) * scale for kk in diag_k]  # [B, H, T, 1] each
        p = torch.softmax(torch.cat([sc] + extra, dim=-1), dim=-1)
        o = p[..., :t] @ v0
        for j, vv in enumerate(diag_v):
            o = o + p[..., t + j: t + j + 1] * vv
        o = o.transpose(1, 2).reshape(b, t, h_ * d)
        residual = feat + attn.o_proj(o)
        out = residual + layer.mlp(layer.post_attention_layernorm(residual))
        normed = model.norm(out)
        outs.append(normed)
        feat = normed if model.cfg.norm_output else out
    return outs


def step_targets(valid: torch.Tensor, lab: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Per step s the slots whose prediction is trained: slot t >= 1 (it has a parent feature), position
    t + s inside the sequence and labelled (the token after it is an answer token)."""
    b, t = valid.shape
    out = []
    for s in range(steps):
        m = torch.zeros_like(valid)
        if s < t:
            m[:, 1:t - s] = valid[:, 1 + s:] & lab[:, 1 + s:]
        out.append(m)
    return out


def shift(x: torch.Tensor, s: int) -> torch.Tensor:
    """x [B, T, ...] -> row t = x[t + s] (zeros past the end)."""
    if s == 0:
        return x
    return torch.cat([x[:, s:], torch.zeros_like(x[:, :s])], dim=1)


def soft_ce(logits: torch.Tensor, ids: torch.Tensor, p: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """logits [M, Vd] over draft rows; the target's top-k (ids [M, k] target ids, p [M, k]) -> mean of
    -sum_k p_k log q(row of id_k), ids without a draft row dropped (q is 0 there at any parameters)."""
    rows = t2d[ids.long()]                                  # [M, k], -1 = no draft row
    lq = F.log_softmax(logits.float(), dim=-1)
    picked = lq.gather(1, rows.clamp(min=0))
    return -(p.float() * picked * (rows >= 0)).sum(-1).mean()
