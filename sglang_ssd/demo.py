"""The CPU demo: the real SmolLM2 target served by SGLang on CPU, without speculation (AR), with plain
speculative decoding (SD = saguaro sync mode) and with SSD (saguaro async mode).

``python -m sglang_ssd.demo [--modes ar,sd,ssd] [--max-new-tokens 64] [--k 4] [--dtype float32]``
The target runs pinned to core 0; the draft process pins itself to the last core (SD uses the same
two cores, so SD and SSD run on identical hardware).
"""

from __future__ import annotations

import argparse
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


def run_mode(mode: str, args, prompts: list[list[int]], workdir: str) -> dict:
    extra = ["--dtype", args.dtype, "--max-running-requests", "8"]
    env = {}
    stats_file = os.path.join(workdir, f"{mode}_stats.json")
    if mode != "ar":
        extra += ["--speculative-algorithm", "saguaro", "--speculative-draft-model-path", args.draft]
        extra += ["--speculative-num-steps", str(args.k)] if args.k else []  # none: the plugin measures, picks
        env["SGLANG_SSD_CONFIG"] = json.dumps({"mode": "sync" if mode == "sd" else "async", "fan_out": args.fan_out,
                                               "draft_dtype": args.dtype, "stats_file": stats_file})
    log_path = os.path.join(workdir, f"{mode}_server.log")
    t0 = time.perf_counter()
    with SGLangServer(args.target, extra, env=env, cpu_core=0, log_path=log_path) as srv:
        startup = time.perf_counter() - t0
        sp = {"temperature": 0, "max_new_tokens": args.max_new_tokens}
        srv.generate(input_ids=prompts[0], sampling_params={"temperature": 0, "max_new_tokens": 4})  # warm-up
        texts, tokens, elapsed, accept = [], 0, 0.0, []
        for ids in prompts:  # batch size 1: one request at a time
            t = time.perf_counter()
            out = srv.generate(input_ids=ids, sampling_params=sp)
            elapsed += time.perf_counter() - t
            tokens += out["meta_info"]["completion_tokens"]
            texts.append(out["text"])
            accept.append(out["meta_info"].get("spec_accept_length"))
    stats = json.load(open(stats_file)) if os.path.exists(stats_file) else {}
    return {"mode": mode, "startup_s": startup, "tokens": tokens, "seconds": elapsed,
            "tok_per_s": tokens / elapsed, "texts": texts, "stats": stats}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=paths.target_path())
    ap.add_argument("--draft", default=paths.draft_path())
    ap.add_argument("--modes", default="ar,sd,ssd")
    # K: by default the plugin's own choice from this CPU's measured verify costs (spec_algo.default_k);
    # fan-out 4: the best predicted SSD speed for the trained draft on the CPU miniature (results/draft_quality.md)
    ap.add_argument("--k", type=int, default=0, help="drafts per round (0: let saguaro measure and choose)")
    ap.add_argument("--fan-out", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"],
                    help="float32 by default: this class of CPU (AVX2, no AMX) gains nothing from bf16")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.target)
    prompts = [chat_prompt(tok, p) for p in PROMPTS]
    workdir = tempfile.mkdtemp(prefix="sglang-ssd-demo-")
    results = [run_mode(m, args, prompts, workdir) for m in args.modes.split(",")]

    names = {"ar": "AR (no speculation)", "sd": "SD (saguaro sync)", "ssd": "SSD (saguaro async)"}
    first = results[0]
    print("\n=== SmolLM2-135M-Instruct served by SGLang on CPU (greedy) ===")
    for prompt, text in zip(PROMPTS, first["texts"]):
        print(f"\n> {prompt}\n{text.strip()}")
    print(f"\n{'mode':<22}{'tok/s':>8}{'vs AR':>8}{'K':>4}{'accept len':>12}{'hit rate':>10}{'draft wait ms':>15}")
    ar = next((r for r in results if r["mode"] == "ar"), None)
    for r in results:
        st = r["stats"]
        ratio = f"{r['tok_per_s'] / ar['tok_per_s']:.2f}x" if ar else "-"
        acc = f"{st['accept_len']:.2f}" if st else "-"
        hit = f"{st['hit_rate']:.2f}" if st else "-"
        wait = f"{st['draft_wait_ms']:.1f}" if st else "-"
        k = str(st.get("k", "-")) if st else "-"
        print(f"{names.get(r['mode'], r['mode']):<22}{r['tok_per_s']:>8.1f}{ratio:>8}{k:>4}{acc:>12}{hit:>10}{wait:>15}")
    same = all(r["texts"] == first["texts"] for r in results)
    print(f"\ngreedy outputs identical across modes: {same}   (logs and stats: {workdir})")


if __name__ == "__main__":
    main()
