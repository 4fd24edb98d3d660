#!/usr/bin/env python
"""Configuration A/B on the CPU miniature: several saguaro configurations (and AR) side by side, one run.

Each variant is one server (target on core 0, draft on core 1, as scripts/bench_cpu.py), measured on the same
prompts, batch sizes and temperatures, so a hot-path change or a setting reports before/after ratios from one run.
A variant is a name, a mode (ar / sd / ssd), optional SGLANG_SSD_CONFIG overrides, an optional target dtype and
an optional "tree": a checkout whose sglang_ssd the variant's server and draft run (PYTHONPATH), for a
before/after of two commits in one run (e.g. `git worktree add /tmp/before <rev>`):

    python scripts/bench_variants.py --name draft-dtype --batches 1 --temps 0,1 --tokens 64 \
        --variant '{"name": "ssd-f32", "mode": "ssd"}' \
        --variant '{"name": "ssd-bf16", "mode": "ssd", "config": {"draft_dtype": "bfloat16"}}'

Writes results/variants_<name>.{json,md} (per variant and cell: tok/s, accept length, hit rate and the round's
time split; ratios against the first variant of each mode and against AR when an AR variant is given).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_cpu import PROMPTS, cell_prompts, machine, ordered_prompts, run_cell  # noqa: E402
from measure_draft import encode_prompt  # noqa: E402
from sglang_ssd import paths  # noqa: E402
from sglang_ssd.serving import SGLangServer  # noqa: E402

log = logging.getLogger("bench_variants")
RESULTS = HERE.parent / "results"
COLUMNS = ("tok_s", "accept_len", "hit_rate", "wait_ms", "draft_answer_ms", "verify_ms", "sched_gap_ms",
           "build_ms", "resets", "deadline_misses")


def server(v: dict, k: int, workdir: str) -> SGLangServer:
    extra = ["--dtype", v.get("target_dtype", "float32"), "--max-running-requests", "8"]
    env, name = {}, v["name"]
    endpoint, stats = f"ipc://{workdir}/{name}.sock", os.path.join(workdir, f"{name}.json")
    if v["mode"] != "ar":
        extra += ["--speculative-algorithm", "saguaro", "--speculative-draft-model-path", paths.draft_path(),
                  "--speculative-num-steps", str(k)]
        cfg = {"mode": "sync" if v["mode"] == "sd" else "async", "fan_out": 4, "draft_endpoint": endpoint,
               "stats_file": stats, "stats_interval": 100000, **v.get("config", {})}
        env["SGLANG_SSD_CONFIG"] = json.dumps(cfg)
    if v.get("tree"):  # the server, and the draft it spawns, import sglang_ssd from that checkout
        env["PYTHONPATH"] = os.pathsep.join([str(Path(v["tree"]).resolve()), os.environ.get("PYTHONPATH", "")])
    srv = SGLangServer(paths.target_path(), extra, env=env, cpu_core=0, log_path=os.path.join(workdir, f"{name}.log"))
    srv.endpoint, srv.stats_path = (endpoint if v["mode"] != "ar" else None), stats
    return srv


def report(state: dict) -> str:
    lines = [f"# Variants: {state['name']}", "",
             f"{state['machine']['cpu']}, {state['machine']['cores']} cores; torch {state['machine']['torch']}, "
             f"SGLang {state['machine']['sglang']}. Target on core 0, draft on core 1; K = {state['k']}, "
             f"{state['tokens']} tokens per request (EOS ignored); one server per variant, the same prompts for "
             f"every variant (scripts/bench_variants.py, one run).", "",
             "| variant | mode | T | b | " + " | ".join(COLUMNS) + " | vs first of mode | vs AR |",
             "|---|---|---|---|" + "---|" * (len(COLUMNS) + 2)]
    variants = state["variants"]
    for key in sorted({(c["temperature"], c["batch"]) for c in state["cells"].values()}):
        firsts, ar = {}, None
        for v in variants:
            c = state["cells"].get(f"{v['name']}|{key[0]}|{key[1]}")
            if c is None:
                continue
            if v["mode"] == "ar":
                ar = ar or c["tok_s"]
            first = firsts.setdefault(v["mode"], c["tok_s"])
            vals = [str(c.get(col, "-")) for col in COLUMNS]
            lines.append(f"| {v['name']} | {v['mode']} | {key[0]:g} | {key[1]} | " + " | ".join(vals)
                         + f" | {c['tok_s'] / first:.3f} | " + (f"{c['tok_s'] / ar:.3f}" if ar else "-") + " |")
    lines += ["", "Variants:", ""] + [f"- `{v['name']}`: `{json.dumps(v)}`" for v in variants]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--name", required=True)
    ap.add_argument("--variant", action="append", required=True, type=json.loads)
    ap.add_argument("--batches", default="1")
    ap.add_argument("--temps", default="0,1")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--rep", type=int, default=0, help="which prompts (bench_cpu's repeat index)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(paths.target_path())
    order = ordered_prompts(json.loads(PROMPTS.read_text())["prompts"])
    out = RESULTS / f"variants_{args.name}"
    state = {"name": args.name, "machine": machine(), "k": args.k, "tokens": args.tokens,
             "variants": args.variant, "cells": {}}
    workdir = tempfile.mkdtemp(prefix="bench-variants-")
    for v in args.variant:
        with server(v, args.k, workdir) as srv:
            srv.generate(input_ids=encode_prompt(tok, order[0]), sampling_params={"max_new_tokens": 8})  # warm-up
            for t in (float(x) for x in args.temps.split(",")):
                for b in (int(x) for x in args.batches.split(",")):
                    c = {"tier": 1 if b == 1 else 2, "temperature": t, "batch": b, "rep": args.rep}
                    items = cell_prompts(order, c)
                    r = run_cell(srv, c, [encode_prompt(tok, p) for p in items], args.tokens)
                    state["cells"][f"{v['name']}|{t}|{b}"] = {**c, "variant": v["name"], **r}
                    log.info("%s T=%g b=%d: %.2f tok/s", v["name"], t, b, r["tok_s"])
                    out.with_suffix(".json").write_text(json.dumps(state, indent=1) + "\n")
        out.with_suffix(".md").write_text(report(state))
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
