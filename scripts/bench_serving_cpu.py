#!/usr/bin/env python
"""Serving comparison (issue 6): SGLang's own serving benchmark against AR, SD and SSD servers.

For each mode this launches the SGLang server (CPU: target on core 0, draft on core 1; GPU: the usual
launch_server) and drives it with ``python -m sglang.benchmark.serving --backend sglang --dataset-name
custom`` on a fixed prompt set (scripts/prompts_bench.json written as a JSONL conversation file; chat
prompts pre-rendered with the chat template) at several request rates (Poisson arrivals, fixed seed),
then collects the benchmark's own JSON lines into results/serving_bench.{json,md}.

Modes: ar (no speculation), sd (saguaro sync), ssd (saguaro async) and, on a GPU machine only,
standalone: SGLang's built-in STANDALONE speculative decoding with a separate draft model, as a second
SD baseline, launched with
  --speculative-algorithm STANDALONE --speculative-draft-model-path DRAFT --speculative-num-steps K
  --speculative-eagle-topk 1 --speculative-num-draft-tokens K+1
STANDALONE needs a draft with the target's full vocabulary head: by default the 22-layer tuned-lens
draft (models/smollm2-135m-draft-lens); our trained draft's reduced head is a saguaro-only format.

    python scripts/bench_serving_cpu.py [--rates 0.1,0.25,1] [--num-prompts 16] [--output-len 64] [--k 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from sglang_ssd import paths  # noqa: E402
from sglang_ssd.serving import SGLangServer, cpu_machine  # noqa: E402

log = logging.getLogger("bench_serving")
OUT = HERE.parent / "results" / "serving_bench"
KEEP = ("completed", "request_throughput", "output_throughput", "mean_e2e_latency_ms", "median_ttft_ms",
        "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "accept_length", "duration")


def write_dataset(path: Path, tokenizer) -> int:
    """prompts_bench.json as the benchmark's 'custom' JSONL (user turn = the exact prompt text)."""
    items = json.loads((HERE / "prompts_bench.json").read_text())["prompts"]
    with open(path, "w") as fh:
        for p in items:
            text = p["text"]
            if p["kind"] == "chat":
                text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                     tokenize=False)
            fh.write(json.dumps({"conversations": [{"role": "user", "content": text},
                                                   {"role": "assistant", "content": "(fixed output length)"}]}) + "\n")
    return len(items)


def server_args(mode: str, k: int, standalone_draft: str) -> tuple[list[str], dict]:
    extra = ["--max-running-requests", "16"] + (["--dtype", "float32"] if cpu_machine() else [])
    env = {}
    if mode in ("sd", "ssd"):
        extra += ["--speculative-algorithm", "saguaro", "--speculative-draft-model-path", paths.draft_path(),
                  "--speculative-num-steps", str(k)]
        env["SGLANG_SSD_CONFIG"] = json.dumps({"mode": "sync" if mode == "sd" else "async", "fan_out": 4})
    elif mode == "standalone":
        extra += ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", standalone_draft,
                  "--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
                  "--speculative-num-draft-tokens", str(k + 1)]
    return extra, env


def client_env(workdir: Path) -> dict:
    """sglang.benchmark.serving imports Hugging Face `datasets` at module level (for its hub datasets: MMMU,
    LongBench, ...). The custom JSONL dataset never calls it, so where `datasets` is not installed (our CPU
    venv: no hub access here) the client gets a stand-in module that raises if anything does call it."""
    env = dict(os.environ)
    try:
        import datasets  # noqa: F401
    except ImportError:
        shim = workdir / "shim" / "datasets"
        shim.mkdir(parents=True, exist_ok=True)
        (shim / "__init__.py").write_text(
            "def load_dataset(*args, **kwargs):\n"
            "    raise ImportError('Hugging Face datasets is not installed (bench_serving_cpu.py stand-in)')\n")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim.parent), env.get("PYTHONPATH")]))
    return env


def bench(srv: SGLangServer, dataset: Path, rate: float, args, out_file: Path) -> dict:
    cmd = [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang", "--base-url", srv.url,
           "--dataset-name", "custom", "--dataset-path", str(dataset), "--tokenizer", paths.target_path(),
           "--num-prompts", str(args.num_prompts), "--sharegpt-output-len", str(args.output_len),
           "--request-rate", str(rate), "--seed", "1", "--output-file", str(out_file), "--disable-tqdm"]
    # the client is light; keep it off the target's core
    subprocess.run((["taskset", "-c", str(os.cpu_count() - 1)] if cpu_machine() else []) + cmd, check=True,
                   stdout=subprocess.DEVNULL, env=client_env(out_file.parent))
    line = out_file.read_text().strip().splitlines()[-1]
    return {k: v for k, v in json.loads(line).items() if k in KEEP}


def to_md(res: dict) -> str:
    L = ["# Serving benchmark (sglang.benchmark.serving) on the saguaro server (issue 6)", "",
         f"{res['machine']}; {res['num_prompts']} requests per run from scripts/prompts_bench.json, "
         f"{res['output_len']} output tokens each (EOS ignored), Poisson arrivals at the given rate, seed 1, "
         f"K = {res['k']} (scripts/bench_serving_cpu.py).", "",
         "| mode | rate req/s | completed | output tok/s | req/s | median TTFT ms | median TPOT ms | p99 TPOT ms | "
         "mean E2E ms | accept len |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        f = lambda k, d=1: "-" if r.get(k) is None else f"{r[k]:.{d}f}"  # noqa: E731
        L.append(f"| {r['mode']} | {r['rate']} | {r.get('completed')} | {f('output_throughput', 2)} | "
                 f"{f('request_throughput', 3)} | {f('median_ttft_ms', 0)} | {f('median_tpot_ms')} | "
                 f"{f('p99_tpot_ms')} | {f('mean_e2e_latency_ms', 0)} | {f('accept_length', 2)} |")
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default=None, help="default: ar,sd,ssd (+ standalone on GPU)")
    ap.add_argument("--rates", default="0.1,0.25,1")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--standalone-draft", default=paths.lens_draft_path(),
                    help="draft for the STANDALONE baseline (GPU only; needs the full vocabulary head)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from transformers import AutoTokenizer

    modes = (args.modes or ("ar,sd,ssd" if cpu_machine() else "ar,sd,ssd,standalone")).split(",")
    if "standalone" in modes and cpu_machine():
        raise SystemExit("--modes standalone needs a GPU: SGLang's STANDALONE worker has no CPU path")
    workdir = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    dataset = workdir / "prompts.jsonl"
    write_dataset(dataset, AutoTokenizer.from_pretrained(paths.target_path()))
    res = {"machine": "CPU, fp32, target core 0, draft core 1" if cpu_machine() else "GPU",
           "num_prompts": args.num_prompts, "output_len": args.output_len, "k": args.k, "runs": []}
    for mode in modes:
        extra, env = server_args(mode, args.k, args.standalone_draft)
        with SGLangServer(paths.target_path(), extra, env=env, cpu_core=0 if cpu_machine() else None,
                          log_path=str(workdir / f"{mode}.log")) as srv:
            for rate in args.rates.split(","):
                r = bench(srv, dataset, float(rate), args, workdir / f"{mode}-{rate}.jsonl")
                res["runs"].append({"mode": mode, "rate": rate, **r})
                log.info("%s rate %s: %s", mode, rate, r)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(to_md(res))
    print(to_md(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
