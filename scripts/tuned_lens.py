"""The tuned-lens head of the lens draft (scripts/prepare_models.py) and of train_draft.py's starting point.

A linear map M fitted in closed form (ridge least squares, float64) from the target's normalised layer-K hidden
states to its normalised final hidden states on target-scored text (random windows of Python's bundled
`pydoc_data.topics`), folded into an untied head: lm_head = (W_emb * g_final) @ M^T, final norm weight = 1.
"""

from __future__ import annotations

import torch


def fit_corpus(tok, n_tokens: int, chunk: int, seed: int) -> list[list[int]]:
    """Excerpts of pydoc_data.topics (Python's bundled docs): seeded choice of disjoint chunk-token windows."""
    import pydoc_data.topics as pt
    sep = tok("\n\n", add_special_tokens=False)["input_ids"]
    ids, old_max = [], tok.model_max_length
    tok.model_max_length = 1 << 30  # silence the length warning: this only counts tokens, nothing runs on them
    for k in sorted(pt.topics):  # per topic: the whole text is longer than the tokenizer's max length
        ids += tok(pt.topics[k], add_special_tokens=False)["input_ids"] + sep
    tok.model_max_length = old_max
    n_windows = len(ids) // chunk
    g = torch.Generator().manual_seed(seed)
    picks = torch.randperm(n_windows, generator=g)[: max(1, n_tokens // chunk)].tolist()
    return [ids[i * chunk:(i + 1) * chunk] for i in sorted(picks)]


@torch.inference_mode()
def fit_lens(target, chunks: list[list[int]], layer: int, ridge: float) -> torch.Tensor:
    """Ridge least squares M (float64, D x D): rmsnormed(h_layer) @ M ~ rmsnormed(h_final)."""
    eps = target.config.rms_norm_eps
    cap = {}
    hooks = [target.model.layers[layer - 1].register_forward_hook(lambda m, i, o: cap.__setitem__("x", o)),
             target.model.norm.register_forward_hook(lambda m, i, o: cap.__setitem__("y", i[0]))]

    def nrm(x):
        x = (x[0] if isinstance(x, tuple) else x)[0].double()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    d = target.config.hidden_size
    xtx = torch.zeros(d, d, dtype=torch.float64)
    xty = torch.zeros(d, d, dtype=torch.float64)
    try:
        for c in chunks:
            target.model(torch.tensor([c]))
            x, y = nrm(cap["x"]), nrm(cap["y"])
            xtx += x.T @ x
            xty += x.T @ y
    finally:
        for h in hooks:
            h.remove()
    reg = ridge * torch.trace(xtx) / d
    return torch.linalg.solve(xtx + reg * torch.eye(d, dtype=torch.float64), xty)


def lens_head(embed_rows: torch.Tensor, norm_weight: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The untied head (E * g_final) @ M^T (float64 product, fp32 result); its final norm weight is then 1."""
    return ((embed_rows.double() * norm_weight.double()) @ m.T).float()


@torch.no_grad()
def build_draft(target, layers: int, m: torch.Tensor):
    import copy
    from transformers import LlamaForCausalLM
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[:layers]
    cfg.tie_word_embeddings = False
    draft = LlamaForCausalLM(cfg).eval()
    sd = {k: v for k, v in target.state_dict().items()
          if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    sd["lm_head.weight"] = lens_head(target.model.embed_tokens.weight.detach(), target.model.norm.weight.detach(), m)
    sd["model.norm.weight"] = torch.ones_like(target.model.norm.weight)
    res = draft.load_state_dict(sd, strict=False)
    if res.missing_keys or res.unexpected_keys:
        raise RuntimeError(f"draft state dict mismatch: missing {res.missing_keys} unexpected {res.unexpected_keys}")
    return draft
