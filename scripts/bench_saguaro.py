#!/usr/bin/env python
"""Measured effect of the Saguaro options on the CPU SmolLM2 pair (issue 5, section 5).

Serves the prepared pair with SGLang on CPU (target on core 0, draft process on core 1; SSD = async
mode, K = 3, budget B = 16) and measures, per setting, decode tokens/s, accepted length and cache hit
rate (the worker's stats file, as deltas around each phase) plus the draft's own counters:
  A. fan-out: uniform (4 per depth) vs fitted online (fan_out_auto, same budget), T = 0 and T = 1;
  B. Saguaro sampling C in {1.0, 0.8, 0.5} at T = 1 (per request, custom_params.saguaro_c, uniform server);
  C. backup: neural vs fast vs auto at batch sizes 1, 2, 4, 8, 16 (concurrent requests), T = 0.
Prompts: the held-out set's chat, code, factual and math prompts (scripts/prompts_heldout.json).
Writes results/saguaro_bench.json and results/saguaro_bench.md.  Not a test: numbers, not assertions.

Every cell is measured --repeats times (interleaved with the other cells on the same server, so slow drift
of the machine hits all of them alike); the tables show the median and the min-max spread.

    python scripts/bench_saguaro.py [--tokens 48] [--batches 1,2,4,8,16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from measure_draft import encode_prompt, load_prompts  # noqa: E402
from sglang_ssd import paths  # noqa: E402
from sglang_ssd.draft.client import DraftClient  # noqa: E402
from sglang_ssd.serving import SGLangServer  # noqa: E402

log = logging.getLogger("bench_saguaro")
K, FAN = 3, 4


def server(cfg: dict, workdir: str, name: str) -> SGLangServer:
    endpoint = f"ipc://{workdir}/{name}.sock"
    stats = os.path.join(workdir, f"{name}.json")
    env = {"SGLANG_SSD_CONFIG": json.dumps({"mode": "async", "fan_out": FAN, "draft_endpoint": endpoint,
                                            "stats_file": stats, "stats_interval": 1000, **cfg})}
    srv = SGLangServer(paths.target_path(), ["--dtype", "float32", "--max-running-requests", "16",
                                             "--speculative-algorithm", "saguaro", "--speculative-draft-model-path",
                                             paths.draft_path(), "--speculative-num-steps", str(K)],
                       env=env, cpu_core=0, log_path=os.path.join(workdir, f"{name}.log"))
    srv.endpoint, srv.stats_path = endpoint, stats
    return srv


def _stats(srv) -> dict:
    try:
        return json.load(open(srv.stats_path))
    except (OSError, ValueError):
        return {}


def phase(srv, prompts, sp: dict, concurrency: int) -> dict:
    """Run all prompts (`concurrency` at a time); tok/s over the phase and stats deltas."""
    before = _stats(srv)
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(lambda ids: srv.generate(input_ids=ids, sampling_params=dict(sp)), prompts))
    dt = time.perf_counter() - t0
    time.sleep(0.3)
    after = _stats(srv)
    rows = after.get("rows", 0) - before.get("rows", 0)
    toks = sum(o["meta_info"]["completion_tokens"] for o in outs)
    acc = after.get("accept_len", 0) * after.get("rows", 0) - before.get("accept_len", 0) * before.get("rows", 0)
    return {"tokens": toks, "seconds": round(dt, 2), "tok_s": round(toks / dt, 2), "rows": rows,
            "accept_len": round(acc / max(rows, 1), 3),
            "hit_rate": round((after.get("hits", 0) - before.get("hits", 0)) / max(rows, 1), 3),
            "errors": after.get("errors", 0) - before.get("errors", 0)}


def summarise(runs: list[dict], **key) -> dict:
    """One table cell from repeated phases: medians and min-max of tok/s, accept length, hit rate."""
    out = dict(key, repeats=len(runs), runs=runs, errors=sum(r["errors"] for r in runs))
    for m in ("tok_s", "accept_len", "hit_rate"):
        vals = [r[m] for r in runs]
        out[m], out[m + "_min"], out[m + "_max"] = round(statistics.median(vals), 3), min(vals), max(vals)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=HERE.parent / "results" / "saguaro_bench")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(paths.target_path())
    prompts = [encode_prompt(tok, p) for p in load_prompts()]
    few = prompts[::5]  # one prompt of each kind (chat, code, factual, math)
    workdir = tempfile.mkdtemp(prefix="saguaro-bench-")
    res = {"k": K, "fan_out": FAN, "tokens": args.tokens, "prompts": len(few), "repeats": args.repeats,
           "fan_out_runs": [], "saguaro_c_runs": [], "backup_runs": []}
    base = {"max_new_tokens": args.tokens, "ignore_eos": True}
    reps = range(args.repeats)
    for name, cfg in (("uniform", {"fan_out_auto": False}), ("auto", {"fan_out_auto": True})):
        with server(cfg, workdir, f"fan-{name}") as srv:
            phase(srv, few[:2], dict(base, temperature=0), 1)  # warm-up (and first planner data)
            cells = {}
            for rep in reps:
                for temp in (0.0, 1.0):
                    r = phase(srv, few, dict(base, temperature=temp), 1)
                    cells.setdefault(("T", temp), []).append(r)
                    log.info("[%d] fan-out %s T=%s: %s", rep, name, temp, r)
                if name == "uniform":
                    for c in (1.0, 0.8, 0.5):
                        r = phase(srv, few, dict(base, temperature=1.0, custom_params={"saguaro_c": c}), 1)
                        cells.setdefault(("C", c), []).append(r)
                        log.info("[%d] C=%s: %s", rep, c, r)
            for (kind, v), runs in cells.items():
                if kind == "T":
                    res["fan_out_runs"].append(summarise(runs, fan_out=name, temperature=v))
                else:
                    res["saguaro_c_runs"].append(summarise(runs, saguaro_c=v))
            with DraftClient(srv.endpoint, timeout_s=30) as client:
                res[f"draft_health_{name}"] = client.health()
    for kind in ("neural", "fast", "auto"):
        with server({"backup": kind, "fan_out_auto": False}, workdir, f"backup-{kind}") as srv:
            phase(srv, few[:2], dict(base, temperature=0), 1)
            cells = {}
            for rep in reps:
                for b in (int(x) for x in args.batches.split(",")):
                    batch = [prompts[(i + rep) % len(prompts)] for i in range(b)]
                    r = phase(srv, batch, dict(base, temperature=0, max_new_tokens=32), b)
                    cells.setdefault(b, []).append(r)
                    log.info("[%d] backup %s b=%d: %s", rep, kind, b, r)
            res["backup_runs"] += [summarise(runs, backup=kind, batch=b) for b, runs in cells.items()]
            with DraftClient(srv.endpoint, timeout_s=30) as client:
                res[f"draft_health_backup_{kind}"] = client.health()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(to_md(res))
    print(to_md(res))
    return 0


def _cell(r: dict, m: str) -> str:
    """median [min-max] of one metric over the repeats."""
    return f"{r[m]:.2f} [{r[m + '_min']:.2f}-{r[m + '_max']:.2f}]"


def to_md(res: dict) -> str:
    L = [f"# Saguaro options on the CPU SmolLM2 pair (issue 5)", "",
         f"SGLang on CPU, fp32, trained draft (assets/draft), SSD (async), K = {res['k']}, budget B = {4 * FAN}, "
         f"{res['tokens']} tokens per request, target on core 0, draft on core 1 (scripts/bench_saguaro.py). "
         f"Each cell: median [min-max] over {res['repeats']} repeats, interleaved with the other cells. "
         f"The Saguaro C and backup tables use the uniform fan-out (fan_out_auto false).", "",
         "| fan-out | T | tok/s | accept len | hit rate |", "|---|---|---|---|---|"]
    L += [f"| {r['fan_out']} | {r['temperature']} | {_cell(r, 'tok_s')} | {_cell(r, 'accept_len')} | "
          f"{_cell(r, 'hit_rate')} |" for r in res["fan_out_runs"]]
    L += ["", "| Saguaro C (T = 1) | tok/s | accept len | hit rate |", "|---|---|---|---|"]
    L += [f"| {r['saguaro_c']} | {_cell(r, 'tok_s')} | {_cell(r, 'accept_len')} | {_cell(r, 'hit_rate')} |"
          for r in res["saguaro_c_runs"]]
    L += ["", "| backup | batch | tok/s | accept len | hit rate |", "|---|---|---|---|---|"]
    L += [f"| {r['backup']} | {r['batch']} | {_cell(r, 'tok_s')} | {_cell(r, 'accept_len')} | "
          f"{_cell(r, 'hit_rate')} |" for r in res["backup_runs"]]
    h = res.get("draft_health_auto", {})
    if "fanout_observations" in h:
        from sglang_ssd.draft.stats import format_health
        L += ["", "Draft's view after the fitted fan-out runs (python -m sglang_ssd.draft.stats):", "", "```",
              format_health(h), "```"]
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    sys.exit(main())
