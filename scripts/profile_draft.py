#!/usr/bin/env python
"""Where the draft's time goes (issue 6 profile): per-forward timings of the real draft engine on one core.

Runs the trained draft in-process (DraftEngine, the code the draft process runs) through SSD rounds that
all miss (so every round pays the just-in-time backup decode AND the next cache build) and times every
draft forward: the backup's K steps, the cache build's glue forward and its K tree depths (one batched
forward per depth over all (K+1) x F branches of all requests), plus Saguaro sampling (C = 0.5) vs plain,
and the wire cost of a SpecReply (encode + decode of tokens and the float16 q rows).
Writes results/draft_profile.{json,md}.

    taskset -c 1 python scripts/profile_draft.py [--batches 1,4] [--k 3] [--fan-out 4] [--rounds 12]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from sglang_ssd import paths
from sglang_ssd.draft.engine import DraftEngine
from sglang_ssd.draft.runner import DraftRunner
from sglang_ssd.protocol import PROTOCOL_VERSION, Hello, Prefill, SpecReply, Speculate, decode

log = logging.getLogger("profile_draft")
OUT = Path(__file__).resolve().parent.parent / "results" / "draft_profile"


def sync(device: torch.device) -> None:
    """On a GPU a forward returns before its kernels finish: wait for them before reading a timer."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def all_miss_engine(runner: DraftRunner, b: int, k: int, fan: int, temp: float, c: float):
    """A DraftEngine in async mode (neural backup, fan-out `fan` at every depth) with b prefilled random
    48-token requests -> (engine, request ids, generator); miss_round then runs one round that misses."""
    eng = DraftEngine(runner, seed=0, max_batch=256)
    eng.hello(Hello(PROTOCOL_VERSION, "profile", k, "async", [fan] * (k + 1), runner.vocab_size, [],
                    [fan] * (k + 1), "neural", False))
    g = torch.Generator().manual_seed(0)
    rids = [f"r{i}" for i in range(b)]
    prompts = [torch.randint(0, 8000, (48,), generator=g).tolist() for _ in rids]
    eng.prefill(Prefill(rids, prompts, [temp] * b, [c] * b))
    return eng, rids, g


def miss_round(eng: DraftEngine, rids: list, g: torch.Generator, r: int, temp: float) -> None:
    """Round r's Speculate with a random bonus (a miss every round: the just-in-time backup answers)."""
    ks = [-1 if r == 0 else 0] * len(rids)
    bonuses = torch.randint(0, 8000, (len(rids),), generator=g).tolist()
    eng.speculate(Speculate(r + 1, rids, ks, bonuses, [temp] * len(rids)))


def profile(runner: DraftRunner, b: int, k: int, fan: int, temp: float, c: float, rounds: int) -> dict:
    eng, rids, g = all_miss_engine(runner, b, k, fan, temp, c)
    calls, phase = [], {"name": "", "i": 0, "round": 0}
    orig = runner.forward

    def timed(items, **kw):
        sync(runner.device)
        t0 = time.perf_counter()
        out = orig(items, **kw)
        sync(runner.device)
        calls.append((phase["round"], phase["name"], phase["i"], sum(len(it.tokens) for it in items),
                      (time.perf_counter() - t0) * 1e3))
        phase["i"] += 1
        return out

    runner.forward = timed
    try:
        for r in range(rounds):
            phase.update(name="backup", i=0, round=r)
            sync(runner.device)
            t0 = time.perf_counter()
            miss_round(eng, rids, g, r, temp)
            sync(runner.device)
            answer = (time.perf_counter() - t0) * 1e3
            phase.update(name="build", i=0)
            t1 = time.perf_counter()
            eng.build_cache()
            sync(runner.device)
            calls.append((r, "answer", 0, 0, answer))
            calls.append((r, "build_total", 0, 0, (time.perf_counter() - t1) * 1e3))
    finally:
        runner.forward = orig
    out = {"batch": b, "k": k, "fan_out": fan, "temperature": temp, "saguaro_c": c}

    def med(name, i=None):
        vals = [ms for r, n, j, _, ms in calls if r >= 2 and n == name and (i is None or j == i)]  # 2 warm-up
        return round(statistics.median(vals), 2) if vals else None

    out["answer_ms"] = med("answer")
    out["backup_step_ms"] = [med("backup", i) for i in range(k)]
    out["glue_ms"] = med("build", 0)
    out["tree_depth_ms"] = [med("build", i) for i in range(1, k + 1)]
    out["build_ms"] = med("build_total")
    out["tree_tokens_per_depth"] = next((n for _, name, j, n, _ in calls if name == "build" and j == 1), None)
    return out


def wire_cost(b: int, k: int, v: int, reps: int = 20) -> float:
    """ms to encode + decode one SpecReply with q rows for all b requests (sampled decoding)."""
    q = np.random.default_rng(0).random((b, k, v)).astype(np.float16)
    msg = SpecReply(round_id=1, tokens=np.zeros((b, k), np.int64), hit=np.zeros(b, np.bool_),
                    q_rows=np.arange(b, dtype=np.int64), q=q)
    t0 = time.perf_counter()
    for _ in range(reps):
        decode([bytes(f) for f in msg.encode()])
    return round((time.perf_counter() - t0) * 1e3 / reps, 2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--fan-out", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    runner = DraftRunner.from_dir(paths.draft_path(), "cpu", "float32")
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        for temp, c in ((0.0, 1.0), (1.0, 1.0), (1.0, 0.5)):
            r = profile(runner, b, args.k, args.fan_out, temp, c, args.rounds)
            r["wire_ms"] = wire_cost(b, args.k, runner.vocab_size) if temp > 0 else 0.0
            rows.append(r)
            log.info("%s", r)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    L = ["# Draft profile: per-forward times of the trained draft (one core, fp32)", "",
         f"scripts/profile_draft.py: every round misses (just-in-time backup, then the next cache build); K = "
         f"{args.k}, fan-out {args.fan_out} per depth ((K+1) x F = {(args.k + 1) * args.fan_out} branches per "
         f"request per tree depth); medians over {args.rounds - 2} rounds.", "",
         "| b | T | C | answer (backup) ms | backup steps ms | glue ms | tree depth 1..K ms | build total ms | "
         "SpecReply wire ms |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        L.append(f"| {r['batch']} | {r['temperature']:g} | {r['saguaro_c']:g} | {r['answer_ms']} | "
                 f"{' / '.join(str(x) for x in r['backup_step_ms'])} | {r['glue_ms']} | "
                 f"{' / '.join(str(x) for x in r['tree_depth_ms'])} | {r['build_ms']} | {r['wire_ms']} |")
    args.out.with_suffix(".md").write_text("\n".join(L) + "\n")
    print("\n".join(L))
    return 0


if __name__ == "__main__":
    sys.exit(main())
