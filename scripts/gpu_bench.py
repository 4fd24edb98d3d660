"""AR / SD / SSD on one or two GPUs with the synthetic pair (scripts/make_synthetic_pair.py).

Part of scripts/gpu_check.sh; writes results/gpu_check.json and results/gpu_check.md.  Servers:
AR (plain SGLang), then saguaro sync (SD) and async (SSD) with the equal draft (acceptance ~1) and
the noisy draft (acceptance < 1).  The target runs on cuda:0; the draft on cuda:1 when there is a
second GPU, else on cuda:0 too -- then target and draft compete for one GPU and the SSD numbers are
a LOWER BOUND (the results say so).  Each cell: b concurrent requests of 64 random prompt tokens,
128 new tokens each (ignore_eos, T = 0), one timed wave after a warm-up request.  A time budget
skips the remaining cells (recorded as skipped) so the whole check fits its window.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from sglang_ssd.serving import SGLangServer  # noqa: E402

logger = logging.getLogger("gpu_bench")
PROMPT, NEW = 64, 128


def run_cell(srv: SGLangServer, b: int, vocab: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(10, vocab, (PROMPT,), generator=g).tolist() for _ in range(b)]
    sp = {"temperature": 0.0, "max_new_tokens": NEW, "ignore_eos": True}
    with ThreadPoolExecutor(b) as ex:
        t0 = time.perf_counter()
        outs = list(ex.map(lambda p: srv.generate(input_ids=p, sampling_params=sp), prompts))
        wall = time.perf_counter() - t0
    toks = sum(len(o.get("output_ids", [])) for o in outs)
    acc = [o["meta_info"].get("spec_accept_length") for o in outs if o["meta_info"].get("spec_accept_length")]
    return {"tok_s": toks / wall, "wall_s": wall, "tokens": toks,
            "accept_len": sum(acc) / len(acc) if acc else None,
            "first_ids": outs[0].get("output_ids", [])[:16]}


def write_results(args, rows: list, n_gpu: int, shared: bool, draft_dev: str, t_start: float) -> None:
    """results/gpu_check.{json,md}; rewritten after every server so a cut-off run keeps what it measured."""
    ar = {r["b"]: r for r in rows if r["mode"] == "AR" and "tok_s" in r}
    for r in rows:
        if "tok_s" in r and r["b"] in ar:
            r["vs_ar"] = r["tok_s"] / ar[r["b"]]["tok_s"]
            # greedy exactness, first request's first 16 tokens (bf16 batch numerics may differ)
            r["same_as_ar"] = r["first_ids"] == ar[r["b"]]["first_ids"]
    note = ("target and draft SHARE one GPU (cuda:0): SSD numbers are a lower bound" if shared
            else f"target on cuda:0, draft on {draft_dev}")
    res = {"device": torch.cuda.get_device_name(0), "gpus": n_gpu, "shared_gpu": shared, "note": note,
           "k": args.k, "prompt_tokens": PROMPT, "new_tokens": NEW, "pytest_rc": args.pytest_rc,
           "pytest_summary": args.pytest_summary, "elapsed_s": time.monotonic() - t_start, "rows": rows}
    with open(os.path.join(args.out, "gpu_check.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    lines = [f"# GPU check ({res['device']} x {n_gpu})", "", f"- {note}",
             f"- GPU tests: rc={args.pytest_rc} {args.pytest_summary}",
             f"- synthetic Llama pair, K={args.k}, {PROMPT} prompt + {NEW} new tokens, T=0, one wave per cell", "",
             "| mode | draft | b | tok/s | vs AR | accept len | same tokens as AR | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fmt = lambda x, f: f.format(x) if isinstance(x, (int, float)) else "-"
        lines.append(f"| {r['mode']} | {r['draft'] or '-'} | {r['b']} | {fmt(r.get('tok_s'), '{:.1f}')} | "
                     f"{fmt(r.get('vs_ar'), '{:.2f}x')} | {fmt(r.get('accept_len'), '{:.2f}')} | "
                     f"{ {True: 'yes', False: 'NO'}.get(r.get('same_as_ar'), '-')} | "
                     f"{r.get('error') or r.get('skipped') or ''} |")
    with open(os.path.join(args.out, "gpu_check.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pair", help="dir written by make_synthetic_pair.py")
    ap.add_argument("--out", default="results")
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--budget-s", type=float, default=330.0)
    ap.add_argument("--pytest-rc", type=int, default=None)
    ap.add_argument("--pytest-summary", default="")
    args = ap.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s: %(message)s")
    t_start = time.monotonic()
    os.makedirs(args.out, exist_ok=True)
    n_gpu = torch.cuda.device_count()
    shared = n_gpu < 2
    draft_dev = "cuda:0" if shared else "cuda:1"
    target = os.path.join(args.pair, "target")
    vocab = json.load(open(os.path.join(target, "config.json")))["vocab_size"]
    common = ["--skip-tokenizer-init", "--dtype", "bfloat16", "--max-running-requests", "16",
              "--cuda-graph-max-bs", "16", "--random-seed", "0",
              "--mem-fraction-static", "0.45" if shared else "0.8"]
    spec = ["--speculative-algorithm", "saguaro", "--speculative-num-steps", str(args.k)]
    configs = [("AR", None, None)] + [(m, d, mode) for d in ("draft_equal", "draft_noisy")
                                      for m, mode in (("SD", "sync"), ("SSD", "async"))]
    rows = []
    bss = [int(x) for x in args.batch_sizes.split(",")]
    for name, draft, mode in configs:
        if time.monotonic() - t_start > args.budget_s:
            rows += [{"mode": name, "draft": draft, "b": b, "skipped": "time budget"} for b in bss]
            write_results(args, rows, n_gpu, shared, draft_dev, t_start)
            continue
        extra, env = list(common), {}
        if draft:
            extra += spec + ["--speculative-draft-model-path", os.path.join(args.pair, draft)]
            env["SGLANG_SSD_CONFIG"] = json.dumps({"mode": mode, "draft_device": draft_dev,
                                                   "stats_file": os.path.join(args.out, f"gpu_check_{name}_{draft}.stats.json")})
        log = os.path.join(args.out, f"gpu_check_{name}_{draft or 'none'}.log")
        try:
            with SGLangServer(target, extra, env=env, startup_timeout=240, log_path=log) as srv:
                srv.generate(input_ids=list(range(10, 26)), sampling_params={"max_new_tokens": 8})  # warm-up
                for b in bss:
                    cell = run_cell(srv, b, vocab, seed=b)
                    rows.append({"mode": name, "draft": draft, "b": b, **cell})
                    logger.info("%s %s b=%d: %.1f tok/s accept_len %s", name, draft, b, cell["tok_s"], cell["accept_len"])
        except Exception as exc:  # one failing server must not hide the others' numbers
            logger.error("%s %s failed: %s (log %s)", name, draft, exc, log)
            rows += [{"mode": name, "draft": draft, "b": b, "error": f"{type(exc).__name__}: {exc}", "log": log}
                     for b in bss if not any(r["mode"] == name and r["draft"] == draft and r["b"] == b for r in rows)]
        write_results(args, rows, n_gpu, shared, draft_dev, t_start)
    logger.info("wrote %s/gpu_check.{json,md}", args.out)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
