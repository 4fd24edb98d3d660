"""Batched sampling of the target's own answers with a static KV cache (issue 15, item 1).

HF ``generate`` managed about 40 tokens/s at batch 48 on one CPU core; this loop runs the target in
our own plain-torch Llama (sglang_ssd/draft/model.py, the same code the draft runs) over a static
per-layer KV buffer [B, Hkv, L, d]:

  prefill  the prompts packed token-flat into one forward (no pad computed), causal attention per
           prompt; logits only at each row's last prompt token.
  decode   one [B] forward per step: row b's new K/V go to slot len_b, its query sees slots <= len_b
           (a boolean mask), so rows of different lengths share one SDPA call per layer.

Every generated position keeps the top-k of the target's T = 1 softmax (the distillation label, as in
draft_data.py; computed per step for the whole batch, so no [steps, B, V] logits are held); tokens are drawn at the job's temperature from softmax(logits / T) (argmax at
T = 0), EOS ends a row (kept: predicting it is part of the distribution).  Hidden states are not
stored: they are a deterministic function of the stored tokens and cost ~3.5 KB per position per
layer kept, so an EAGLE trainer re-scores the tokens (teacher forcing runs ~5x faster than sampling).

    taskset -c 0 python scripts/fast_generate.py    # tokens/s vs HF generate -> results/gen_speed.{json,md}
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sglang_ssd.draft.model import CausalLM  # noqa: E402
from sglang_ssd.saguaro.verify import sample_inverse_cdf  # noqa: E402

log = logging.getLogger("fast_generate")


@dataclass
class Generated:
    tokens: list[list[int]]        # per row: the generated tokens (EOS included when it came)
    topk_ids: list[torch.Tensor]   # per row: int32 [n_b, k] top-k ids of softmax(raw logits) at each token
    topk_p: list[torch.Tensor]     # per row: float16 [n_b, k] their probabilities


class StaticBatchGenerator:
    """``gen = StaticBatchGenerator(model); out = gen.generate(prompts, 96, temperature, seed, eos)``."""

    def __init__(self, model: CausalLM):
        self.model = model
        self.cfg = model.cfg
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device

    def _alloc(self, b: int, length: int) -> None:
        c = self.cfg
        shape = (b, c.num_kv_heads, length, c.head_dim)
        self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(c.num_layers)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(c.num_layers)]

    def _prefill(self, prompts: list[list[int]], rows: list[int]) -> torch.Tensor:
        """All prompts packed into one token-flat forward (no padding computed), causal attention per
        prompt; prompt i's KV goes to slots 0..len_i-1 of batch row rows[i] -> logits at each last token."""
        lens = [len(p) for p in prompts]
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        ids = torch.as_tensor([t for p in prompts for t in p], dtype=torch.long, device=self.device)
        pos = torch.cat([torch.arange(n) for n in lens]).to(self.device)

        def attn(layer, q, k, v):  # token-flat [T, H, d]
            out = torch.empty_like(q)
            for b, s, n in zip(rows, starts, lens):
                kb, vb = k[s:s + n].transpose(0, 1), v[s:s + n].transpose(0, 1)  # [Hkv, n, d]
                self.k[layer][b, :, :n] = kb
                self.v[layer][b, :, :n] = vb
                o = F.scaled_dot_product_attention(q[s:s + n].transpose(0, 1)[None], kb[None], vb[None],
                                                   is_causal=True, enable_gqa=True)
                out[s:s + n] = o[0].transpose(0, 1)
            return out

        hidden = self.model(ids, pos, attn)
        return self.model.logits(hidden[torch.as_tensor(starts[1:], device=self.device) - 1])

    def _decode(self, tokens: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """tokens [B] at positions lens [B] -> logits [B, V]; K/V written at slot lens_b of row b."""
        b = tokens.shape[0]
        rows = torch.arange(b, device=self.device)
        n = int(lens.max()) + 1
        visible = (torch.arange(n, device=self.device)[None, :] <= lens[:, None])[:, None, None, :]

        def attn(layer, q, k, v):  # q [B, H, d], k / v [B, Hkv, d]
            self.k[layer][rows, :, lens] = k
            self.v[layer][rows, :, lens] = v
            o = F.scaled_dot_product_attention(q[:, :, None], self.k[layer][:, :, :n], self.v[layer][:, :, :n],
                                               attn_mask=visible, enable_gqa=True)
            return o[:, :, 0]

        return self.model.logits(self.model(tokens, lens, attn))

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new: int, temperature: float, seed: int,
                 eos_id: Optional[int], topk: int = 32, batch: Optional[int] = None) -> Generated:
        """Answers for every prompt (results in prompt order), `batch` rows at a time (default: all).

        A row whose answer ends (EOS or max_new) takes the next waiting prompt: once a few rows are
        free their prompts are prefilled together into them (their stale slots are never visible: a
        query sees slots <= its row's length), so the batch stays full while prompts wait."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        rows = min(batch or len(prompts), len(prompts))
        self._alloc(rows, max(map(len, prompts)) + max_new)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        owner = list(range(rows))  # prompt index each row is answering (-1: idle, nothing left to answer)
        waiting = list(range(rows, len(prompts)))[::-1]  # a stack: pop() gives the next prompt in order
        lens = torch.as_tensor([len(prompts[i]) for i in owner], device=self.device)  # next free slot per row
        logits = self._prefill([prompts[i] for i in owner], list(range(rows)))
        out_tok: list[list[int]] = [[] for _ in prompts]
        out_ids: list[list[torch.Tensor]] = [[] for _ in prompts]
        out_p: list[list[torch.Tensor]] = [[] for _ in prompts]
        refill_at = max(1, rows // 16)  # free rows gathered before one refill prefill
        free: list[int] = []
        while any(o >= 0 for o in owner):
            logits = logits.float()
            p1 = torch.softmax(logits, dim=-1)  # the label: the target's T = 1 distribution
            val, idx = p1.topk(topk, dim=-1)
            val, idx = val.to(torch.float16).cpu(), idx.to(torch.int32).cpu()
            # inverse-CDF draws (one uniform per row): torch.multinomial cost ~130 ms per step at 128 rows
            if temperature == 1.0:
                nxt = sample_inverse_cdf(p1, gen)
            elif temperature > 0:
                nxt = sample_inverse_cdf(torch.softmax(logits / temperature, dim=-1), gen)
            else:
                nxt = logits.argmax(dim=-1)
            for r, i in enumerate(owner):
                if i < 0 or r in free:
                    continue
                t = int(nxt[r])
                out_tok[i].append(t)
                out_ids[i].append(idx[r])
                out_p[i].append(val[r])
                if (eos_id is not None and t == eos_id) or len(out_tok[i]) == max_new:
                    free.append(r)
            dead = [r for r, o in enumerate(owner) if o < 0 or r in free]
            if len(dead) == rows and not waiting:
                break
            if dead:  # nothing of theirs is read any more: they decode at slot 0 (a static batch), ignored
                lens[dead] = 0
            logits = self._decode(nxt, lens)
            lens = lens + 1
            if free and (len(free) >= refill_at or not waiting or len(free) + sum(o < 0 for o in owner) == rows):
                take = [(r, waiting.pop()) for r in free if waiting]
                for r in free[len(take):]:
                    owner[r] = -1
                if take:
                    rs = [r for r, _ in take]
                    logits[rs] = self._prefill([prompts[i] for _, i in take], rs)
                    lens[rs] = torch.as_tensor([len(prompts[i]) for _, i in take], device=self.device)
                    for r, i in take:
                        owner[r] = i
                free = []
        return Generated(out_tok, [torch.stack(x) for x in out_ids], [torch.stack(x) for x in out_p])


def _hf_generate(hf, prompts: list[list[int]], steps: int, eos: int) -> int:
    """The previous data loop: HF generate, left-padded, T = 1, raw logits kept -> tokens generated."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.as_tensor(p), 1
    with torch.inference_mode():
        res = hf.generate(ids, attention_mask=mask, max_new_tokens=steps, do_sample=True, temperature=1.0, top_k=0,
                          top_p=1.0, pad_token_id=eos, eos_token_id=eos, output_logits=True,
                          return_dict_in_generate=True)
    gen = res.sequences[:, width:].tolist()
    return sum(g.index(eos) + 1 if eos in g else len(g) for g in gen)


def bench(batches: list[int], hf_batch: int, steps: int, threads: int, per_row: int = 4) -> dict:
    """Generated tokens/s (prefill included) of this loop at each batch size and of HF generate, on the
    training prompts (scripts/prompts_train.py), T = 1, EOS ends a row; one run, side by side."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prompts_train import train_prompts
    from sglang_ssd import paths
    from sglang_ssd.draft.model import load_model

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(paths.target_path())
    prompts = train_prompts(tok, 0)
    ours = StaticBatchGenerator(load_model(paths.target_path()))
    rows, off = [], 0
    for b in batches:
        # per_row prompts per row: finished rows get refilled, and the last wave's tail (rows idle while the
        # longest answers end) is amortised as in a data job of many prompts
        batch, off = prompts[off:off + per_row * b], off + per_row * b
        t0 = time.perf_counter()
        out = ours.generate(batch, steps, 1.0, 0, eos_id=tok.eos_token_id, batch=b)
        wall = time.perf_counter() - t0
        n = sum(map(len, out.tokens))
        rows.append({"loop": "static KV (ours), refilled rows", "batch": b, "prompts": len(batch),
                     "prompt_tokens": sum(map(len, batch)), "generated": n, "seconds": wall, "tok_s": n / wall})
        log.info("ours b=%d: %d tokens in %.1fs = %.0f tok/s", b, n, wall, n / wall)
    hf = AutoModelForCausalLM.from_pretrained(paths.target_path(), dtype=torch.float32).eval()
    batch = prompts[off:off + hf_batch]
    t0 = time.perf_counter()
    n = _hf_generate(hf, batch, steps, tok.eos_token_id)
    wall = time.perf_counter() - t0
    rows.append({"loop": "HF generate", "batch": hf_batch, "prompts": len(batch), "prompt_tokens": sum(map(len, batch)),
                 "generated": n, "seconds": wall, "tok_s": n / wall})
    log.info("HF b=%d: %d tokens in %.1fs = %.0f tok/s", hf_batch, n, wall, n / wall)
    return {"threads": threads, "max_new_tokens": steps, "temperature": 1.0, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="128")
    ap.add_argument("--prompts-per-row", type=int, default=4)
    ap.add_argument("--hf-batch", type=int, default=48)
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="results/gen_speed")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    res = bench([int(x) for x in args.batches.split(",")], args.hf_batch, args.steps, args.threads,
                args.prompts_per_row)
    res["cpu"] = _cpu_name()
    with open(args.out + ".json", "w") as fh:
        json.dump(res, fh, indent=1)
    hf = next(r["tok_s"] for r in res["rows"] if r["loop"] == "HF generate")
    lines = ["# Data generation speed: the target's own answers (issue 15, item 1)", "",
             f"CPU: {res['cpu']}, {args.threads} thread(s), one core (taskset), fp32, T = 1, up to {args.steps} new "
             "tokens per prompt (EOS ends a row), the training prompts of scripts/prompts_train.py, prefill included "
             "(scripts/fast_generate.py, one run, side by side). Target: >= 150 generated tokens/s on one core.", "",
             "| loop | batch rows | prompts | prompt tokens | generated tokens | seconds | tokens/s | vs HF generate |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['loop']} | {r['batch']} | {r['prompts']} | {r['prompt_tokens']} | {r['generated']} | {r['seconds']:.1f} | "
                     f"{r['tok_s']:.0f} | {r['tok_s'] / hf:.2f}x |")
    with open(args.out + ".md", "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            return next(ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
