"""The CPU demo: the real SmolLM2 target served by SGLang on CPU, without speculation (AR), with plain
speculative decoding (SD = saguaro sync mode) and with SSD (saguaro async mode).

``python -m sglang_ssd.demo [--modes ar,sd,ssd] [--max-new-tokens 64] [--k 4] [--passes 2] [--dtype float32]``
The target runs pinned to core 0; the draft process pins itself to the last core (SD uses the same
two cores, so SD and SSD run on identical hardware).  All modes' servers are up together and take turns
prompt by prompt, the idle ones paused: run one mode after another instead and a shared machine's drift
over those minutes lands on whichever mode ran last (seen on an Intel Xeon VM: SSD at 0.79x AR run last,
1.09-1.18x side by side; results/variants_xeon2_interference.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import tempfile
import time

from sglang_ssd import paths
from sglang_ssd.serving import SGLangServer

logger = logging.getLogger("sglang_ssd.demo")

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that checks whether a number is prime.",
    "Give me three tips for staying focused while studying.",
    "A shop sells pens at 3 dollars each. How much do 7 pens cost? Explain briefly.",
]


def chat_prompt(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def start_server(mode: str, args, prompts: list[list[int]], workdir: str, stack: contextlib.ExitStack) -> SGLangServer:
    """Start one mode's server (target pinned to core 0), warm it up, and leave it paused."""
    extra = ["--dtype", args.dtype, "--max-running-requests", "8"]
    env = {}
    if mode != "ar":
        extra += ["--speculative-algorithm", "saguaro", "--speculative-draft-model-path", args.draft]
        extra += ["--speculative-num-steps", str(args.k)] if args.k else []  # none: the plugin measures, picks
        env["SGLANG_SSD_CONFIG"] = json.dumps({"mode": "sync" if mode == "sd" else "async", "fan_out": args.fan_out,
                                               "draft_dtype": args.draft_dtype,
                                               "stats_file": os.path.join(workdir, f"{mode}_stats.json")})
    t0 = time.perf_counter()
    srv = stack.enter_context(SGLangServer(args.target, extra, env=env, cpu_core=0,
                                           log_path=os.path.join(workdir, f"{mode}_server.log")))
    logger.info("%s server up in %.0f s", mode, time.perf_counter() - t0)
    srv.generate(input_ids=prompts[0], sampling_params={"temperature": 0, "max_new_tokens": 4})  # warm-up
    srv.pause()
    return srv


def run_interleaved(servers: dict[str, SGLangServer], prompts: list[list[int]], max_new_tokens: int,
                    passes: int) -> dict[str, dict]:
    """Every prompt on every mode in turn (batch size 1, greedy), the other servers paused, the mode order
    alternating from one prompt to the next: a machine whose speed drifts (a shared host) slows every mode
    alike instead of whichever ran last.  -> per mode: tokens, seconds, tok/s and texts of every pass."""
    sp = {"temperature": 0, "max_new_tokens": max_new_tokens}
    res = {m: {"tokens": 0, "seconds": 0.0, "texts": [[] for _ in range(passes)]} for m in servers}
    n = 0
    for p in range(passes):
        for ids in prompts:
            order = list(servers) if n % 2 == 0 else list(servers)[::-1]
            n += 1
            for mode in order:
                srv = servers[mode]
                srv.resume()
                time.sleep(0.5)  # let the woken scheduler settle before the clock starts
                t = time.perf_counter()
                out = srv.generate(input_ids=ids, sampling_params=sp)
                res[mode]["seconds"] += time.perf_counter() - t
                srv.pause()
                res[mode]["tokens"] += out["meta_info"]["completion_tokens"]
                res[mode]["texts"][p].append(out["text"])
    for r in res.values():
        r["tok_per_s"] = r["tokens"] / r["seconds"]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=paths.target_path())
    ap.add_argument("--draft", default=paths.draft_path())
    ap.add_argument("--modes", default="ar,sd,ssd")
    # K: by default the plugin's own choice from this CPU's measured verify costs (spec_algo.default_k);
    # fan-out 4: the best predicted SSD speed for the trained draft on the CPU miniature (results/draft_quality.md)
    ap.add_argument("--k", type=int, default=0, help="drafts per round (0: let saguaro measure and choose)")
    ap.add_argument("--fan-out", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--passes", type=int, default=2, help="times each prompt runs on each mode")
    ap.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"],
                    help="the target's dtype; float32 by default: this class of CPU (AVX2, no AMX) gains nothing "
                         "from bf16")
    ap.add_argument("--draft-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="the draft's dtype; auto (the plugin's default): bfloat16 where this CPU's bf16 products "
                         "are measured faster (sglang_ssd/draft/cpu_dtype.py), else float32")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.target)
    prompts = [chat_prompt(tok, p) for p in PROMPTS]
    workdir = tempfile.mkdtemp(prefix="sglang-ssd-demo-")
    modes = args.modes.split(",")
    with contextlib.ExitStack() as stack:
        servers = {m: start_server(m, args, prompts, workdir, stack) for m in modes}
        results = run_interleaved(servers, prompts, args.max_new_tokens, args.passes)
    for m in modes:
        f = os.path.join(workdir, f"{m}_stats.json")
        results[m]["stats"] = json.load(open(f)) if os.path.exists(f) else {}

    names = {"ar": "AR (no speculation)", "sd": "SD (saguaro sync)", "ssd": "SSD (saguaro async)"}
    first = results[modes[0]]["texts"][0]
    print("\n=== SmolLM2-135M-Instruct served by SGLang on CPU (greedy) ===")
    for prompt, text in zip(PROMPTS, first):
        print(f"\n> {prompt}\n{text.strip()}")
    print(f"\n{len(PROMPTS)} prompts x {args.passes} passes per mode, batch size 1, modes taking turns prompt by "
          f"prompt (the idle servers paused), so a drifting machine slows every mode alike")
    print(f"\n{'mode':<22}{'tok/s':>8}{'vs AR':>8}{'K':>4}{'accept len':>12}{'hit rate':>10}{'draft wait ms':>15}")
    ar = results.get("ar")
    for m in modes:
        r, st = results[m], results[m]["stats"]
        ratio = f"{r['tok_per_s'] / ar['tok_per_s']:.2f}x" if ar else "-"
        acc = f"{st['accept_len']:.2f}" if st else "-"
        hit = f"{st['hit_rate']:.2f}" if st else "-"
        wait = f"{st['draft_wait_ms']:.1f}" if st else "-"
        k = str(st.get("k", "-")) if st else "-"
        print(f"{names.get(m, m):<22}{r['tok_per_s']:>8.1f}{ratio:>8}{k:>4}{acc:>12}{hit:>10}{wait:>15}")
    same = all(texts == first for r in results.values() for texts in r["texts"])
    print(f"\ngreedy outputs identical across modes and passes: {same}   (logs and stats: {workdir})")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
