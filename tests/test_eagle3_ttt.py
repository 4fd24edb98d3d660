"""Training-time test (scripts/eagle3_ttt.py) computes what the served EAGLE-3 head computes.

Step s at slot t of the batched TTT forward must equal the serving model (sglang_ssd.draft.eagle3, the
forward the draft engine runs) decoding s tokens past its last target feature: a causal extend of
positions 0..t over projected target features, then positions t+1..t+s one at a time, each fed the
previous position's own output.  A random one-layer head, padded batch rows of different lengths.
"""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from eagle3_ttt import shift, soft_ce, step_targets, ttt_forward  # noqa: E402
from sglang_ssd.draft.eagle3 import Eagle3Config, Eagle3Draft  # noqa: E402

V, D, DT, H, HKV, HD, FF, DV = 64, 32, 24, 4, 2, 8, 48, 40


def _head(seed=0) -> Eagle3Draft:
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": D,
           "intermediate_size": FF, "num_attention_heads": H, "num_key_value_heads": HKV, "head_dim": HD,
           "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": V,
           "draft_vocab_size": DV, "target_hidden_size": DT, "tie_word_embeddings": False,
           "max_position_embeddings": 512, "hidden_act": "silu",
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}
    torch.manual_seed(seed)
    m = Eagle3Draft(Eagle3Config.from_hf_dict(cfg))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return m.eval()


class _KV:
    """attn fn with a growing cache: the new rows attend to everything before them and causally among them."""

    def __init__(self):
        self.k = self.v = None

    def __call__(self, layer, q, k, v):
        self.k = k if self.k is None else torch.cat([self.k, k])
        self.v = v if self.v is None else torch.cat([self.v, v])
        n, tot = q.shape[0], self.k.shape[0]
        mask = torch.arange(tot)[None, :] <= (tot - n + torch.arange(n))[:, None]
        o = F.scaled_dot_product_attention(q.transpose(0, 1), self.k.transpose(0, 1), self.v.transpose(0, 1),
                                           attn_mask=mask, enable_gqa=True)
        return o.transpose(0, 1)


def _served(m: Eagle3Draft, toks, aux, t, s):
    """The served head's normed hidden predicting x_{t+s+1}: extend 0..t on target features, then s steps."""
    kv = _KV()
    g = m.project(aux)
    feats = torch.cat([torch.zeros(1, D), g[:t]])  # slot i reads position i - 1
    hid, out = m(toks[: t + 1], torch.arange(t + 1), feats, kv)
    h, f = hid[-1:], out[-1:]
    for j in range(1, s + 1):
        h, f = m(toks[t + j: t + j + 1], torch.tensor([t + j]), f, kv)
    return h[0]


@pytest.mark.parametrize("norm_output", [False, True])
def test_ttt_steps_equal_served_decode(norm_output):
    m = _head()
    m.cfg.norm_output = norm_output
    lens, steps = [11, 7], 4
    w = max(lens)
    toks = torch.randint(0, V, (2, w))
    aux = torch.randn(2, w, 3 * DT)
    valid = torch.arange(w)[None, :] < torch.tensor(lens)[:, None]
    toks[~valid] = 0
    with torch.no_grad():
        outs = ttt_forward(m, toks, aux, valid, steps)
        checked = 0
        for r, n in enumerate(lens):
            for s in range(steps):
                for t in range(n - s):
                    ref = _served(m, toks[r, :n], aux[r, :n], t, s)
                    assert torch.allclose(outs[s][r, t], ref, atol=1e-4), (r, s, t, (outs[s][r, t] - ref).abs().max())
                    checked += 1
    assert checked == sum(sum(n - s for s in range(steps)) for n in lens)


def test_step_targets_and_shift():
    valid = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    lab = torch.tensor([[False, False, True, True, True, False], [False, True, True, False, False, False]])
    m = step_targets(valid, lab, 3)
    # step s, slot t trains iff t >= 1 and lab[t + s] (inside the sequence)
    for s in range(3):
        for r in range(2):
            for t in range(6):
                want = t >= 1 and t + s < 6 and bool(valid[r, t + s] and lab[r, t + s])
                assert bool(m[s][r, t]) == want, (s, r, t)
    x = torch.arange(12).view(2, 6)
    assert shift(x, 2).tolist() == [[2, 3, 4, 5, 0, 0], [8, 9, 10, 11, 0, 0]]


def test_soft_ce_drops_ids_without_a_draft_row():
    t2d = torch.full((V,), -1, dtype=torch.long)
    t2d[:DV] = torch.arange(DV)
    logits = torch.randn(3, DV)
    ids = torch.tensor([[0, 5, 50], [1, 2, 3], [60, 61, 62]])
    p = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1], [0.4, 0.4, 0.2]])
    lq = F.log_softmax(logits, -1)
    want = -(0.5 * lq[0, 0] + 0.3 * lq[0, 5] + 0.6 * lq[1, 1] + 0.3 * lq[1, 2] + 0.1 * lq[1, 3]) / 3
    assert torch.allclose(soft_ce(logits, ids, p, t2d), want)
