#!/usr/bin/env python
"""The draft side of SSD on a GPU, without SGLang: what a lent GPU machine with no network can run.

SGLang 0.5.23's GPU stack (sglang-kernel 0.4.10, torch 2.14.1) cannot be installed on a machine that
reaches no package registry, so the SGLang server cells of scripts/gpu_check.sh need a set-up GPU
machine.  This script measures what needs only torch, FlashInfer and this package:

* draft cost: the real DraftEngine (the draft process's code) through SSD rounds that all miss
  (scripts/profile_draft.py's `profile`: the just-in-time backup's K steps, then the next cache build's
  glue forward and its K tree depths), with the default draft's shape (2 layers, hidden 576, reduced
  head of 8,192 ids; random weights: same cost), per attention backend (FlashInfer + CUDA graphs,
  FlashInfer eager, SDPA), b = 1 / 4 / 16, T = 0 / 1;
* a target-shaped forward (SmolLM2-135M's shape, 30 layers, random weights) in the same runner: one
  decode step and a chain of K+1 tokens per request at a given context, as a stand-in for the target's
  AR step and chain verify (NOT SGLang's model runner; labelled so in the results).

    python scripts/gpu_draft_bench.py [--out DIR] [--batches 1,4,16] [--rounds 12] [--ctx 512]

Writes DIR/gpu_draft_bench.{json,md} (default results/).
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_draft import profile, sync  # noqa: E402
from sglang_ssd.draft.config import ModelConfig  # noqa: E402
from sglang_ssd.draft.model import CausalLM  # noqa: E402
from sglang_ssd.draft.runner import DraftRunner, ForwardItem  # noqa: E402

log = logging.getLogger("gpu_draft_bench")
SMOLLM2 = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
           "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5,
           "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}
SHAPES = {  # the default draft (assets/draft) and its target, as config.json dicts
    "draft": {**SMOLLM2, "num_hidden_layers": 2, "tie_word_embeddings": False, "ssd_head_vocab": 8192},
    "target": {**SMOLLM2, "num_hidden_layers": 30, "tie_word_embeddings": True},
}
BACKENDS = (("flashinfer+graphs", "flashinfer", True), ("flashinfer", "flashinfer", False), ("sdpa", "sdpa", False))


def random_model(shape: str, device: str, dtype: torch.dtype, seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    cfg = ModelConfig.from_hf_dict(SHAPES[shape])
    model = CausalLM(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    if model.head_ids is not None:
        model.head_ids.copy_(torch.randperm(cfg.vocab_size)[: cfg.head_vocab].sort().values)
    model.inv_freq = cfg.inv_freq()
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    model.inv_freq = cfg.inv_freq().to(device)
    return model


def target_forward(runner: DraftRunner, b: int, ctx: int, k: int, reps: int) -> dict:
    """Median ms of one decode step (1 token per request) and of a K+1-token chain per request, each
    at ~ctx tokens of context, over `reps` timed calls (KV grows as it would in serving)."""
    g = torch.Generator().manual_seed(1)
    kvs = [runner.new_kv(ctx + (reps + 2) * (k + 2)) for _ in range(b)]
    for kv in kvs:  # prefill in chunks of 512
        for s in range(0, ctx, 512):
            n = min(512, ctx - s)
            runner.forward([ForwardItem.extend(kv, torch.randint(0, 8000, (n,), generator=g).tolist(), s)])
    pos = [ctx] * b
    out = {}
    for name, q in (("decode_ms", 1), (f"chain{k + 1}_ms", k + 1)):
        times = []
        for r in range(reps + 2):
            items = [ForwardItem.extend(kv, torch.randint(0, 8000, (q,), generator=g).tolist(), p, n_logits=q)
                     for kv, p in zip(kvs, pos)]
            sync(runner.device)
            t0 = time.perf_counter()
            runner.forward(items)
            sync(runner.device)
            if r >= 2:  # 2 warm-ups (graph capture of a new bucket)
                times.append((time.perf_counter() - t0) * 1e3)
            pos = [p + q for p in pos]
        out[name] = round(statistics.median(times), 3)
    out["chain_over_decode"] = round(out[f"chain{k + 1}_ms"] / out["decode_ms"], 3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--fan-out", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--backends", default="sdpa,flashinfer+graphs,flashinfer",
                    help="variants to run, in this order: " + ", ".join(b[0] for b in BACKENDS))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    dev, dtype = args.device, torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    batches = [int(x) for x in args.batches.split(",")]
    wanted = args.backends.split(",")
    res = {"device": torch.cuda.get_device_name(dev) if dev.startswith("cuda") else "cpu",
           "torch": torch.__version__, "dtype": str(dtype), "k": args.k, "fan_out": args.fan_out, "ctx": args.ctx,
           "draft": [], "target": []}
    known = {b[0]: b for b in BACKENDS}
    bad = [w for w in wanted if w not in known]
    if bad:
        ap.error(f"unknown backend variant(s) {bad}; known: {list(known)}")
    args.out.mkdir(parents=True, exist_ok=True)
    for label, backend, graphs in (known[w] for w in wanted):  # in the order asked; results written after each
        t0 = time.perf_counter()
        runner = DraftRunner(random_model("draft", dev, dtype), dev, backend, graphs)
        start_s = round(time.perf_counter() - t0, 2)
        log.info("draft runner %s: backend %s, start %.2f s, %s", label, runner.backend, start_s, runner.health())
        for b in batches:
            for temp in (0.0, 1.0):
                r = profile(runner, b, args.k, args.fan_out, temp, 1.0, args.rounds)
                r.update(variant=label, backend=runner.backend, start_s=start_s, health=runner.health())
                res["draft"].append(r)
                log.info("%s", r)
        del runner
        t0 = time.perf_counter()
        runner = DraftRunner(random_model("target", dev, dtype), dev, backend, graphs)
        start_s = round(time.perf_counter() - t0, 2)
        for b in batches:
            r = target_forward(runner, b, args.ctx, args.k, args.reps)
            r.update(variant=label, backend=runner.backend, batch=b, start_s=start_s)
            res["target"].append(r)
            log.info("target-shaped %s", r)
        del runner
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
        (args.out / "gpu_draft_bench.json").write_text(json.dumps(res, indent=1) + "\n")
        (args.out / "gpu_draft_bench.md").write_text(report(res) + "\n")
    print(report(res))
    return 0


def report(res: dict) -> str:
    k = res["k"]
    L = [f"# The draft side of SSD on {res['device']} (torch {res['torch']}, {res['dtype']})", "",
         "scripts/gpu_draft_bench.py. Random weights in the default draft's shape (2 layers, hidden 576, reduced "
         f"head 8,192) and in SmolLM2-135M's shape (30 layers) for the target stand-in. K = {k}, fan-out "
         f"{res['fan_out']} per depth; draft rounds all miss (backup, then the next cache build); medians.", "",
         "## Draft (the real DraftEngine)", "",
         "| backend | b | T | answer (backup) ms | backup steps ms | glue ms | tree depths ms | build ms |",
         "|---|---|---|---|---|---|---|---|"]
    for r in res["draft"]:
        L.append(f"| {r['variant']} ({r['backend']}) | {r['batch']} | {r['temperature']:g} | {r['answer_ms']} | "
                 f"{' / '.join(str(x) for x in r['backup_step_ms'])} | {r['glue_ms']} | "
                 f"{' / '.join(str(x) for x in r['tree_depth_ms'])} | {r['build_ms']} |")
    L += ["", f"## Target-shaped forward in the same runner (a stand-in, not SGLang), context {res['ctx']}", "",
          f"| backend | b | decode step ms | chain of {k + 1} ms | chain / decode |", "|---|---|---|---|---|"]
    for r in res["target"]:
        L.append(f"| {r['variant']} ({r['backend']}) | {r['batch']} | {r['decode_ms']} | {r[f'chain{k + 1}_ms']} | "
                 f"{r['chain_over_decode']} |")
    return "\n".join(L)


if __name__ == "__main__":
    sys.exit(main())
