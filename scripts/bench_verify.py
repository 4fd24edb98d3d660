#!/usr/bin/env python
"""Cost of a chain verify (K+1 tokens) against one AR decode step, by context and batch size (issue 14).

Both are timed through SGLang's real model runner inside real servers: SGLANG_SSD_FORWARD_TIMING makes
the plugin time every ``ModelRunner.forward`` (sglang_ssd/sglang/forward_timing.py), so plain SGLang's
DECODE steps and saguaro's TARGET_VERIFY rounds are measured by the same hook (model forward + logits,
no sampling).  Servers, target pinned to core 0 (the draft, in sync mode, idles on core 1 while the
target verifies, so nothing interferes):
  - ar:      plain SGLang, no speculation;
  - linear:  saguaro sync mode, K = 3, the linear-cost CPU chain verify (the default);
  - extend:  the same with SGLANG_SSD_CHAIN_VERIFY=extend, torch_native's quadratic extend route (the
             path before this change), at the contexts where it finishes in reasonable time.
Per (context, b): b concurrent requests with real-text prompts of `context` tokens, --new-tokens greedy
tokens (EOS ignored); the median forward time over the forwards whose batch holds all b requests.

    python scripts/bench_verify.py [--contexts 128 512 1024 2048 4096] [--batches 1 8] [--new-tokens 12]
-> results/verify_cost.{json,md}
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import logging
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from sglang_ssd import paths  # noqa: E402
from sglang_ssd.serving import SGLangServer  # noqa: E402

log = logging.getLogger("bench_verify")
OUT = HERE.parent / "results" / "verify_cost"
K = 3
EXTEND_MAX = {1: 2048, 8: 512}  # the quadratic route beyond these contexts takes minutes per cell


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def text_prompts(tokenizer, context: int, count: int) -> list[list[int]]:
    """`count` different real-text prompts of exactly `context` tokens (this project's sources)."""
    root = HERE.parent
    text = "\n\n".join(p.read_text() for p in [root / "README.md", *sorted((root / "sglang_ssd").rglob("*.py"))])
    ids = tokenizer(text)["input_ids"]
    step = max(1, (len(ids) - context) // max(count, 1))
    assert len(ids) >= context + (count - 1) * step, "not enough text for the prompts"
    return [ids[i * step : i * step + context] for i in range(count)]


def run_cell(srv: SGLangServer, timing: Path, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    timing.write_text("")
    sp = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(lambda ids: srv.generate(input_ids=ids, sampling_params=sp), prompts))
    return [json.loads(line) for line in timing.read_text().splitlines() if line.strip()]


def summarize(records: list[dict], mode: str, b: int) -> dict:
    rows = [r for r in records if r["mode"] == mode and r["bs"] == b and not r["draft"]]
    if not rows:
        return {"n": 0}
    ms = [r["ms"] for r in rows]
    return {"n": len(ms), "median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms),
            "mean_seq_len": statistics.mean(statistics.mean(r["seq_lens"]) for r in rows)}


def serve(name: str, target: str, draft: str, ctx_max: int, bmax: int, tmp: Path) -> tuple[SGLangServer, Path]:
    timing = tmp / f"timing-{name}.jsonl"
    env = {"SGLANG_SSD_FORWARD_TIMING": str(timing)}
    args = ["--dtype", "float32", "--random-seed", "1", "--context-length", str(ctx_max + 64),
            "--max-running-requests", str(bmax), "--max-total-tokens", str(bmax * (ctx_max + 64) + 1024),
            "--chunked-prefill-size", "4096"]
    if name != "ar":
        env["SGLANG_SSD_CONFIG"] = json.dumps({"mode": "sync", "draft_endpoint": f"ipc://{tmp}/draft-{name}.sock"})
        args += ["--speculative-algorithm", "saguaro", "--speculative-draft-model-path", draft,
                 "--speculative-num-steps", str(K)]
        if name == "extend":
            env["SGLANG_SSD_CHAIN_VERIFY"] = "extend"
    srv = SGLangServer(target, args, env=env, cpu_core=0, log_path=str(tmp / f"server-{name}.log"))
    return srv.start(), timing


def write_report(res: dict) -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.with_suffix(".json").write_text(json.dumps(res, indent=1))
    lines = ["# Chain verify cost vs AR decode step (issue 14)", "",
             f"CPU: {res['cpu']}; target {res['target']} fp32 pinned to core 0 (taskset; the sync-mode draft idles on core 1 while the target verifies), "
             f"K = {K} (verify of {K + 1} tokens per request), {res['new_tokens']} greedy tokens per request; "
             "times are medians of `ModelRunner.forward` (model + logits, no sampling) over the forwards whose "
             "batch holds all b requests, from scripts/bench_verify.py. Target: verify / AR <= 1.8 at every "
             "context and b = 1, 8." + (f" The old extend route's column is from an earlier run ({res['extend_from']}; "
                                        "not re-run: it takes minutes per cell)." if res.get("extend_from") else ""), "",
             "| b | context | AR decode ms | verify ms (linear) | verify / AR | verify ms (old extend route) | old / AR (its run) |",
             "|---|---|---|---|---|---|---|"]
    for c in res["cells"]:
        ar, lin, ext = (c.get(k, {"n": 0}) for k in ("ar", "linear", "extend"))
        f = lambda s: f"{s['median_ms']:.1f}" if s.get("n") else "-"  # noqa: E731
        r = lambda s: f"{s['median_ms'] / ar['median_ms']:.2f}" if s.get("n") and ar.get("n") else "-"  # noqa: E731
        ext_ar = c.get("extend_ar", ar)
        r_ext = f"{ext['median_ms'] / ext_ar['median_ms']:.2f}" if ext.get("n") and ext_ar.get("n") else "-"
        lines.append(f"| {c['b']} | {c['context']} | {f(ar)} | {f(lin)} | {r(lin)} | {f(ext)} | {r_ext} |")
    ok = [c["linear"]["median_ms"] / c["ar"]["median_ms"] for c in res["cells"]
          if c.get("linear", {}).get("n") and c.get("ar", {}).get("n")]
    if ok:
        lines += ["", f"Largest verify / AR ratio (linear route): {max(ok):.2f} (target <= 1.8)."]
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024, 2048, 4096])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--servers", nargs="+", default=["ar", "linear", "extend"])
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from transformers import AutoTokenizer

    target, draft = paths.target_path(), paths.draft_path()
    tok = AutoTokenizer.from_pretrained(target)
    ctx_max, bmax = max(args.contexts), max(args.batches)
    cells = [{"b": b, "context": c} for b in args.batches for c in args.contexts]
    res = {"cpu": cpu_name(), "target": Path(target).name, "new_tokens": args.new_tokens, "k": K, "cells": cells,
           "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    if "extend" not in args.servers and OUT.with_suffix(".json").exists():  # keep the slow route's earlier cells
        old = json.loads(OUT.with_suffix(".json").read_text())
        prev = {(c["b"], c["context"]): c for c in old.get("cells", [])}
        for c in cells:
            p = prev.get((c["b"], c["context"]), {})
            if p.get("extend", {}).get("n"):  # with that run's own AR step, so its ratio stays one run's
                c["extend"], c["extend_ar"] = p["extend"], p.get("extend_ar") or p["ar"]
        res["extend_from"] = old.get("extend_from") or old.get("started", "date unknown")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.servers:
            srv, timing = serve(name, target, draft, ctx_max, bmax, Path(tmp))
            try:
                for c in cells:
                    if name == "extend" and c["context"] > EXTEND_MAX.get(c["b"], 0):
                        continue
                    recs = run_cell(srv, timing, text_prompts(tok, c["context"], c["b"]), args.new_tokens)
                    c[name] = summarize(recs, "decode" if name == "ar" else "target_verify", c["b"])
                    log.info("%s b=%d ctx=%d: %s", name, c["b"], c["context"], c[name])
                    write_report(res)
            finally:
                srv.stop()
    for c in cells:
        c.setdefault("linear", {"n": 0})
        c.setdefault("ar", {"n": 0})
    write_report(res)
    print(OUT.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
