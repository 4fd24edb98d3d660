#!/usr/bin/env python
"""Measure a draft model against its target: acceptance (alpha) and per-token cost.

alpha greedy = P(draft argmax == target argmax) at every position of the target's own greedy
trajectories (teacher-forced on both models, fp32). alpha T=1 = mean over the same positions of
sum_x min(p(x), q(x)), the expected acceptance of one speculative-sampling step at temperature 1.
Cost ratio = draft 1-token decode time / target 1-token decode time (batch 1, KV cache, ~128-token
context, one thread), in fp32 and bf16.

Usage:
    python scripts/measure_draft.py                       # default cache dir models
    python scripts/measure_draft.py --json results/draft.json
    python scripts/measure_draft.py --target DIR --draft DIR --new-tokens 64 --no-timing
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger("measure_draft")

HERE = Path(__file__).resolve().parent
DEFAULT_PROMPTS = HERE / "prompts_heldout.json"
from sglang_ssd import paths  # noqa: E402
from sglang_ssd.paths import DRAFT_NAME, TARGET_NAME  # noqa: E402  (one place names the cache)


def models_dir() -> Path:
    return Path(paths.models_dir())


def load_prompts(path: Path = DEFAULT_PROMPTS) -> list[dict]:
    with open(path) as f:
        return json.load(f)["prompts"]


def encode_prompt(tok, item: dict) -> list[int]:
    """Chat prompts go through the chat template; the other kinds are raw completions."""
    if item["kind"] == "chat":
        msgs = [{"role": "user", "content": item["text"]}]
        out = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "keys"):  # BatchEncoding in transformers 5
            out = out["input_ids"]
        return list(out)
    return tok(item["text"], add_special_tokens=False)["input_ids"]


@torch.inference_mode()
def greedy_trajectories(target, tok, prompts: list[dict], new_tokens: int) -> list[tuple[torch.Tensor, int]]:
    """Greedy continuation of each prompt by the target; returns (full ids [1, L], prompt length)."""
    seqs = []
    for item in prompts:
        ids = torch.tensor([encode_prompt(tok, item)])
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=tok.pad_token_id)
        seqs.append((out[:, :], ids.shape[1]))
    return seqs


@torch.inference_mode()
def position_logprobs(model, seqs) -> list[torch.Tensor]:
    """Teacher-forced log-probs at the positions predicting each generated token: [n_new, V] fp32."""
    res = []
    for ids, plen in seqs:
        logits = model(ids).logits[0, plen - 1: ids.shape[1] - 1].float()
        res.append(torch.log_softmax(logits, dim=-1))
    return res


def alpha_stats(t_lp: list[torch.Tensor], d_lp: list[torch.Tensor]) -> tuple[list[float], list[float]]:
    """Per-position greedy match (0/1) and T=1 overlap sum_x min(p, q), flattened per prompt."""
    greedy, overlap = [], []
    for tp, dp in zip(t_lp, d_lp):
        greedy.append((tp.argmax(-1) == dp.argmax(-1)).float())
        overlap.append(torch.minimum(tp.exp(), dp.exp()).sum(-1))
    return greedy, overlap


def summarize(prompts, greedy, overlap) -> dict:
    kinds = sorted({p["kind"] for p in prompts})
    out = {}
    for kind in kinds + ["all"]:
        idx = [i for i, p in enumerate(prompts) if kind == "all" or p["kind"] == kind]
        g = torch.cat([greedy[i] for i in idx])
        o = torch.cat([overlap[i] for i in idx])
        out[kind] = {"alpha_greedy": round(g.mean().item(), 4), "alpha_t1": round(o.mean().item(), 4),
                     "positions": int(g.numel()), "prompts": len(idx)}
    return out


@torch.inference_mode()
def _decode_steps(models, ctx_len: int, steps: int, warmup: int) -> list[list[float]]:
    """Interleaved 1-token decode steps (KV cache, ctx_len-token prefill) of several models: ms per step."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, models[0].config.vocab_size, (1, ctx_len), generator=g)
    times = [[] for _ in models]
    state = []
    for m in models:
        out = m(ids, use_cache=True)
        state.append([out.past_key_values, out.logits[:, -1:].argmax(-1)])
    for i in range(warmup + steps):
        for j, m in enumerate(models):  # alternate models so load from other processes hits both alike
            t0 = time.perf_counter()
            out = m(state[j][1], past_key_values=state[j][0], use_cache=True)
            dt = time.perf_counter() - t0
            state[j] = [out.past_key_values, out.logits[:, -1:].argmax(-1)]
            if i >= warmup:
                times[j].append(dt * 1e3)
    return times


def cost_ratios(target, draft, threads: int = 1, ctx_len: int = 128, steps: int = 32, warmup: int = 4) -> dict:
    """Median 1-token decode ms of target and draft (fp32 and bf16) and their ratio; the CPU may be shared,
    so the steps are interleaved and both the median and the minimum are reported."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        res = {}
        for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            t_times, d_times = _decode_steps([target.to(dt), draft.to(dt)], ctx_len, steps, warmup)
            t_ms, d_ms = statistics.median(t_times), statistics.median(d_times)
            res[name] = {"target_ms": round(t_ms, 2), "draft_ms": round(d_ms, 2), "ratio": round(d_ms / t_ms, 3),
                         "ratio_of_min": round(min(d_times) / min(t_times), 3)}
        return res
    finally:
        target.to(torch.float32)
        draft.to(torch.float32)
        torch.set_num_threads(old)


class _OurLM:
    """A draft with a reduced head (not a transformers layout) through our own model code, HF-call-alike."""

    def __init__(self, m):
        from types import SimpleNamespace
        self.m = m
        self.config = SimpleNamespace(num_hidden_layers=m.cfg.num_layers, vocab_size=m.cfg.vocab_size)

    @torch.inference_mode()
    def __call__(self, ids):
        from types import SimpleNamespace
        return SimpleNamespace(logits=self.m.logits(self.m.forward_padded(ids)[0])[None])


def load_model(path, dtype=torch.float32):
    cfg = json.loads((Path(path) / "config.json").read_text())
    if cfg.get("ssd_head_vocab"):
        from sglang_ssd.draft.model import load_model as load_ours
        return _OurLM(load_ours(str(path), dtype=dtype))
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return m.eval()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=None, help=f"default: $SGLANG_SSD_MODELS/{TARGET_NAME}")
    ap.add_argument("--draft", type=Path, default=None, help=f"default: $SGLANG_SSD_MODELS/{DRAFT_NAME}")
    ap.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="torch threads for the alpha part")
    ap.add_argument("--timing-threads", type=int, default=1, help="torch threads for the cost-ratio timing")
    ap.add_argument("--no-timing", action="store_true", help="skip the cost-ratio timing")
    ap.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(args.threads)
    target_dir = args.target or models_dir() / TARGET_NAME
    draft_dir = args.draft or models_dir() / DRAFT_NAME

    from transformers import AutoTokenizer
    phases = {}
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    target = load_model(target_dir)
    draft = load_model(draft_dir)
    if draft.config.vocab_size != target.config.vocab_size:
        log.error("vocab mismatch: draft %d vs target %d", draft.config.vocab_size, target.config.vocab_size)
        return 2
    phases["load_s"] = time.perf_counter() - t0
    prompts = load_prompts(args.prompts)

    t0 = time.perf_counter()
    seqs = greedy_trajectories(target, tok, prompts, args.new_tokens)
    phases["target_generate_s"] = time.perf_counter() - t0
    log.info("target trajectories: %d prompts, %.1fs", len(seqs), phases["target_generate_s"])

    t0 = time.perf_counter()
    t_lp = position_logprobs(target, seqs)
    d_lp = position_logprobs(draft, seqs)
    greedy, overlap = alpha_stats(t_lp, d_lp)
    by_kind = summarize(prompts, greedy, overlap)
    phases["score_s"] = time.perf_counter() - t0

    cost = None
    if isinstance(draft, _OurLM) and not args.no_timing:
        log.info("reduced-head draft: HF-style timing skipped; scripts/draft_quality.py times it with our runner")
    elif not args.no_timing:
        t0 = time.perf_counter()
        cost = cost_ratios(target, draft, threads=args.timing_threads)
        phases["timing_s"] = time.perf_counter() - t0

    result = {"target": str(target_dir), "draft": str(draft_dir),
              "draft_layers": draft.config.num_hidden_layers, "target_layers": target.config.num_hidden_layers,
              "new_tokens": args.new_tokens, "alpha": by_kind, "cost": cost,
              "phases_s": {k: round(v, 1) for k, v in phases.items()}}

    print(f"draft {draft_dir} ({draft.config.num_hidden_layers} layers) vs target "
          f"{target_dir} ({target.config.num_hidden_layers} layers)")
    print(f"{'kind':<10}{'alpha_greedy':>14}{'alpha_T=1':>12}{'positions':>11}")
    for kind, r in by_kind.items():
        print(f"{kind:<10}{r['alpha_greedy']:>14.3f}{r['alpha_t1']:>12.3f}{r['positions']:>11d}")
    if cost:
        for name, c in cost.items():
            print(f"cost {name}: target {c['target_ms']:.1f} ms, draft {c['draft_ms']:.1f} ms, "
                  f"ratio {c['ratio']:.3f} (of min {c['ratio_of_min']:.3f}; 1 thread, batch 1, 1-token decode, ~128-token context)")
    print("phases: " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        log.info("wrote %s", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
