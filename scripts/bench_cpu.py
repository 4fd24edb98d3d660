#!/usr/bin/env python
"""AR vs SD vs SSD on the CPU miniature (issue 6): the paper's experiment at CPU scale, one command.

Serves the prepared SmolLM2 pair with SGLang on CPU, target pinned to core 0 and the draft process to core 1
(SD = saguaro sync mode, SSD = saguaro async mode, AR = plain SGLang; all on the same two cores), and runs
fixed-length generations (128 tokens, EOS ignored) on the benchmark prompts (scripts/prompts_bench.json, 16
per kind: chat, code, factual, math). Sweeps, in priority order (tiers), each cell repeated --repeats times:
  1. headline: b = 1, K = 3, AR / SD / SSD, T = 0 and 1;
  2. batch:    b = 2, 4, 8, K = 3, AR / SD / SSD, T = 0 and 1;
  3. K:        K = 4, 5 for SD / SSD at b = 1, T = 0 and 1 (2 prompts per repeat, a recorded subset);
  4. context:  prompts of about 100, 1k and 3k tokens (a benchmark prompt after a real-text document:
               this project's README and sources), b = 1, K = 3, AR / SD / SSD, T = 0 and 1, 2 prompts per repeat.
Batch size b = b concurrent requests; each repeat sends 4 requests at b = 1 (one per kind) and one wave of
b requests at b > 1, taking the next prompts of the kind-interleaved set, so repeats see different prompts
and every mode sees the same prompts at the same (T, b, repeat). One server per (mode, K); repeats interleave with the T and b
cells on that server, so slow drift of the machine hits all cells alike.

Resumable: every finished cell is saved to results/cpu_bench.json at once; re-running the same command
skips finished cells (it refuses to mix runs whose prompts, models or token count differ: --fresh starts
over). results/cpu_bench.md and the plots (scripts/bench_report.py) are rewritten from all finished cells.

    python scripts/bench_cpu.py [--tiers 1,2,3] [--repeats 3] [--tokens 128] [--fresh]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from measure_draft import encode_prompt  # noqa: E402
from sglang_ssd import paths  # noqa: E402
from sglang_ssd.draft.client import DraftClient  # noqa: E402
from sglang_ssd.serving import SGLangServer  # noqa: E402

log = logging.getLogger("bench_cpu")
PROMPTS = HERE / "prompts_bench.json"
OUT = HERE.parent / "results" / "cpu_bench"
KINDS = ("chat", "code", "factual", "math")
TEMPS = (0.0, 1.0)
CONTEXTS = (100, 1000, 3000)  # tier 4 prompt lengths (tokens)
FAN_OUT = 4  # per depth (budget 4 K), as the demo and results/draft_quality.md
LINK_KEYS = ("rounds", "rows", "hits", "fallback_rows", "waited_rounds", "wait_s", "verify_s", "accept_s",
             "round_s", "gap_s", "answer_s", "backup_s", "errors", "resets", "deadline_misses", "early_prefills",
             "hit_rows", "accepted_hit")
DRAFT_KEYS = ("neural_backup_rows", "fast_backup_rows", "backup_rows", "builds", "builds_cut")


def plan(tiers: set[int], repeats: int) -> list[dict]:
    """All cells in run order: tiers, then server groups (mode, K), then repeats, T, b."""
    groups = []
    if 1 in tiers:
        groups += [(1, m, 0 if m == "ar" else 3, (1,)) for m in ("ar", "sd", "ssd")]
    if 2 in tiers:
        groups += [(2, m, 0 if m == "ar" else 3, (2, 4, 8)) for m in ("ar", "sd", "ssd")]
    if 3 in tiers:
        groups += [(3, m, k, (1,)) for k in (4, 5) for m in ("sd", "ssd")]
    cells = [{"tier": tier, "mode": m, "k": k, "temperature": t, "batch": b, "rep": r}
             for tier, m, k, batches in groups for r in range(repeats) for t in TEMPS for b in batches]
    if 4 in tiers:
        cells += [{"tier": 4, "mode": m, "k": 0 if m == "ar" else 3, "temperature": t, "batch": 1, "rep": r,
                   "context": ctx} for m in ("ar", "sd", "ssd") for r in range(repeats) for t in TEMPS
                  for ctx in CONTEXTS]
    return cells


def cell_key(c: dict) -> str:
    ctx = f"/ctx{c['context']}" if c.get("context") else ""
    return f"{c['mode']}/k{c['k']}/T{c['temperature']}/b{c['batch']}{ctx}/r{c['rep']}"


def context_prompt(tok, item: dict, context: int) -> list[int]:
    """A benchmark prompt after a real-text document, about `context` tokens in all (tier 4); the
    plain prompt when `context` is short.  The document is this project's README and sources."""
    ids = encode_prompt(tok, item)
    if context <= len(ids) + 16:
        return ids
    root = HERE.parent
    text = "\n\n".join(p.read_text() for p in [root / "README.md", *sorted((root / "sglang_ssd").rglob("*.py"))])
    doc = tok(text, add_special_tokens=False)["input_ids"]
    start = (17 * len(item["text"])) % max(1, len(doc) - context)
    return doc[start : start + context - len(ids)] + tok("\n\n", add_special_tokens=False)["input_ids"] + ids


def ordered_prompts(items: list[dict]) -> list[dict]:
    """The set interleaved by kind (chat, code, factual, math, chat, ...) so any 4 consecutive span the kinds."""
    by_kind = {k: [p for p in items if p["kind"] == k] for k in KINDS}
    return [by_kind[k][i] for i in range(min(len(v) for v in by_kind.values())) for k in KINDS]


def cell_prompts(order: list, c: dict) -> list:
    """The cell's prompts for this (T, b, repeat), fixed and recorded: 4 at b = 1 (one per kind), else b (one
    wave of b concurrent requests); successive repeats take the next prompts of the kind-interleaved set.
    Tier 3 (K = 4, 5) uses a recorded subset to fit the two-hour budget: 2 prompts per repeat (alternately the
    first and second half of the K = 3 cell's prompts at the same T and repeat, so repeats span the kinds)."""
    n = (2 if c["tier"] in (3, 4) else 4) if c["batch"] == 1 else c["batch"]
    first = c["rep"] * 4 + 2 * (c["rep"] % 2) if c["tier"] in (3, 4) else c["rep"] * n
    start = (first + (8 if c["temperature"] else 0) + 16 * [1, 2, 4, 8].index(c["batch"])) % len(order)
    return [order[(start + i) % len(order)] for i in range(n)]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def fingerprint(tokens: int) -> dict:
    """What must match for cells of two invocations to be comparable."""
    def model_hash(d: str) -> str:
        files = sorted(Path(d).glob("*.safetensors")) + sorted(Path(d).glob("config.json"))
        return hashlib.sha256("".join(sha256(f) for f in files).encode()).hexdigest()[:16]
    return {"tokens": tokens, "prompts_sha256": sha256(PROMPTS), "fan_out": FAN_OUT,
            "target_sha256": model_hash(paths.target_path()), "draft_sha256": model_hash(paths.draft_path())}


def machine() -> dict:
    import torch
    import sglang
    import transformers
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "sglang": sglang.__version__, "transformers": transformers.__version__, "platform": platform.platform()}


def server(mode: str, k: int, workdir: str) -> SGLangServer:
    extra = ["--dtype", "float32", "--max-running-requests", "8"]
    env, name = {}, f"{mode}-k{k}"
    endpoint, stats = f"ipc://{workdir}/{name}.sock", os.path.join(workdir, f"{name}.json")
    if mode != "ar":
        extra += ["--speculative-algorithm", "saguaro", "--speculative-draft-model-path", paths.draft_path(),
                  "--speculative-num-steps", str(k)]
        env["SGLANG_SSD_CONFIG"] = json.dumps({"mode": "sync" if mode == "sd" else "async", "fan_out": FAN_OUT,
                                               "draft_endpoint": endpoint, "stats_file": stats,
                                               "stats_interval": 100000})
    srv = SGLangServer(paths.target_path(), extra, env=env, cpu_core=0,
                       log_path=os.path.join(workdir, f"{name}.log"))
    srv.endpoint, srv.stats_path = (endpoint if mode != "ar" else None), stats
    return srv


def draft_health(endpoint: str, tree: str | None = None) -> dict:
    """The draft's health counters; a draft of another checkout (bench_variants' "tree": a before/after
    run across a protocol change) is asked by that checkout's own client, in a subprocess."""
    if not tree:
        with DraftClient(endpoint, timeout_s=30) as client:
            return client.health()
    code = ("import json, sys; from sglang_ssd.draft.client import DraftClient\n"
            "with DraftClient(sys.argv[1], timeout_s=30) as c: print(json.dumps(c.health()))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code, endpoint], env=env, cwd=tree, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _snapshot(srv) -> dict:
    """The worker's cumulative counters and the draft's (absent for AR)."""
    if srv.endpoint is None:
        return {}
    try:
        link = json.load(open(srv.stats_path))
    except (OSError, ValueError):
        link = {}
    snap = {k: link.get(k, 0) for k in LINK_KEYS}
    snap["accepted"] = link.get("accept_len", 0) * link.get("rows", 0)
    h = draft_health(srv.endpoint, getattr(srv, "tree", None))
    snap.update({k: h.get(k, 0) for k in DRAFT_KEYS})
    snap["build_s"] = h.get("avg_build_ms", 0) * h.get("builds", 0) / 1000
    return snap


def run_cell(srv, c: dict, prompts: list[list[int]], tokens: int) -> dict:
    """One repeat of one cell: its requests at concurrency b; throughput, latency and round statistics."""
    sp = {"max_new_tokens": tokens, "ignore_eos": True, "temperature": c["temperature"]}
    before = _snapshot(srv)

    def one(ids):
        t = time.perf_counter()
        out = srv.generate(input_ids=ids, sampling_params=dict(sp))
        return out["meta_info"]["completion_tokens"], time.perf_counter() - t

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(c["batch"]) as pool:
        outs = list(pool.map(one, prompts))
    wall = time.perf_counter() - t0
    time.sleep(0.2)  # the stats file is written after each round
    after = _snapshot(srv)
    toks = sum(n for n, _ in outs)
    res = {"requests": len(prompts), "tokens": toks, "seconds": round(wall, 3), "tok_s": round(toks / wall, 3),
           "tpot_ms": round(1000 * sum(dt / n for n, dt in outs) / len(outs), 2)}
    if before:
        d = {k: after[k] - before[k] for k in after}
        rounds, rows = max(d["rounds"], 1), max(d["rows"], 1)
        res.update({"rounds": d["rounds"], "rows": d["rows"], "accept_len": round(d["accepted"] / rows, 3),
                    # tokens per round of cache-hit rows and of the rest (backup and target-only rows)
                    "e_hit": round(d["accepted_hit"] / max(d["hit_rows"], 1), 3),
                    "e_miss": round((d["accepted"] - d["accepted_hit"]) / max(d["rows"] - d["hit_rows"], 1), 3),
                    "hit_rate": round(d["hits"] / rows, 3), "waited_frac": round(d["waited_rounds"] / rounds, 3),
                    "backup_frac": round(d["backup_rows"] / rows, 3),
                    "fast_backup_rows": d["fast_backup_rows"], "fallback_rows": d["fallback_rows"],
                    "errors": d["errors"], "resets": d["resets"], "deadline_misses": d["deadline_misses"],
                    "builds": d["builds"], "builds_cut": d["builds_cut"],
                    # per-round time split (ms): draft wait, target verify forward, exact acceptance,
                    # the rest of the worker, the scheduler between rounds; and the draft's cache builds
                    "wait_ms": round(1000 * d["wait_s"] / rounds, 2),
                    # of the wait: the draft answering (lookup + just-in-time backup decode) vs the rest
                    # (the draft still busy with its previous cache build, plus the RPC itself)
                    "draft_answer_ms": round(1000 * d["answer_s"] / rounds, 2),
                    "draft_backup_ms": round(1000 * d["backup_s"] / rounds, 2),
                    "verify_ms": round(1000 * d["verify_s"] / rounds, 2),
                    "accept_ms": round(1000 * d["accept_s"] / rounds, 2),
                    "worker_other_ms": round(1000 * (d["round_s"] - d["wait_s"] - d["verify_s"] - d["accept_s"])
                                             / rounds, 2),
                    "sched_gap_ms": round(1000 * d["gap_s"] / rounds, 2),
                    "build_ms": round(1000 * d["build_s"] / max(d["builds"], 1), 2)})
    return res


def load_state(out: Path, fp: dict, fresh: bool) -> dict:
    path = out.with_suffix(".json")
    if path.exists() and not fresh:
        state = json.loads(path.read_text())
        if state.get("fingerprint") != fp:
            raise SystemExit(f"{path} was measured with {state.get('fingerprint')}, not {fp}: "
                             f"re-run with --fresh to start over")
        return state
    return {"fingerprint": fp, "cells": {}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiers", default="1,2,3")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--fresh", action="store_true", help="discard finished cells and start over")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from bench_report import write_report

    tok = AutoTokenizer.from_pretrained(paths.target_path())
    order = ordered_prompts(json.loads(PROMPTS.read_text())["prompts"])
    state = load_state(args.out, fingerprint(args.tokens), args.fresh)
    state["machine"], state["repeats"] = machine(), args.repeats
    state["config"] = {"fan_out": FAN_OUT, "dtype": "float32", "target": "SmolLM2-135M-Instruct (core 0)",
                       "draft": "trained 2-layer draft, assets/draft (core 1)", "tokens": args.tokens}
    cells = plan({int(t) for t in args.tiers.split(",")}, args.repeats)
    todo = [c for c in cells if cell_key(c) not in state["cells"]]
    log.info("%d cells planned, %d finished before, %d to run", len(cells), len(cells) - len(todo), len(todo))
    workdir = tempfile.mkdtemp(prefix="bench-cpu-")
    bar = tqdm(total=len(todo), desc="cells", unit="cell")
    groups: dict[tuple, list] = {}
    for c in todo:
        groups.setdefault((c["tier"], c["mode"], c["k"]), []).append(c)
    for (_, mode, k), group in groups.items():
        with server(mode, k, workdir) as srv:
            srv.generate(input_ids=encode_prompt(tok, order[0]), sampling_params={"max_new_tokens": 8})  # warm-up
            for c in group:
                items = cell_prompts(order, c)
                r = run_cell(srv, c, [context_prompt(tok, p, c["context"]) if c.get("context")
                                      else encode_prompt(tok, p) for p in items], args.tokens)
                state["cells"][cell_key(c)] = {**c, "prompts": [order.index(p) for p in items], **r}
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.with_suffix(".json").write_text(json.dumps(state, indent=1) + "\n")
                bar.set_postfix_str(f"{cell_key(c)} {r['tok_s']:.2f} tok/s")
                bar.update()
        write_report(state, args.out)
    bar.close()
    write_report(state, args.out)
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
