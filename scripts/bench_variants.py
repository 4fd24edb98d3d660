#!/usr/bin/env python
"""Configuration A/B on the CPU miniature: several saguaro configurations (and AR) side by side, one run.

Each variant is one server (target on core 0, draft on core 1, as scripts/bench_cpu.py), measured on the same
prompts, batch sizes and temperatures, so a hot-path change or a setting reports before/after ratios from one run.
A variant is a name, a mode (ar / sd / ssd), an optional draft directory ("draft"; default the prepared
trained draft), an optional K ("k"; default --k), optional SGLANG_SSD_CONFIG overrides ("config"), environment
variables for its server and draft ("env"), an optional target dtype and
an optional "tree": a checkout whose sglang_ssd the variant's server and draft run (PYTHONPATH), for a
before/after of two commits in one run (e.g. `git worktree add /tmp/before <rev>`):

    python scripts/bench_variants.py --name draft-dtype --batches 1 --temps 0,1 --tokens 64 \
        --variant '{"name": "ssd-f32", "mode": "ssd"}' \
        --variant '{"name": "ssd-bf16", "mode": "ssd", "config": {"draft_dtype": "bfloat16"}}'

All variants' servers stay up for the whole run (frozen with SIGSTOP while another variant is measured: an idle
SGLang scheduler spins at about half a core) and every cell runs on each variant in turn (ABBA order over
repeats), so slow drift of the machine hits every variant alike. Writes results/variants_<name>.{json,md}
(per variant and cell, medians over repeats: tok/s, accept length, hit rate and the round's time split; per
repeat ratios against the first variant of each mode and against AR when an AR variant is given).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_cpu import PROMPTS, cell_prompts, machine, ordered_prompts, run_cell  # noqa: E402
from measure_draft import encode_prompt  # noqa: E402
from sglang_ssd import paths  # noqa: E402
from sglang_ssd.serving import SGLangServer  # noqa: E402

log = logging.getLogger("bench_variants")
RESULTS = HERE.parent / "results"
COLUMNS = ("k", "tok_s", "accept_len", "e_hit", "e_miss", "hit_rate", "wait_ms", "draft_answer_ms", "verify_ms", "sched_gap_ms",
           "build_ms", "resets", "deadline_misses")


def server(v: dict, k: int, workdir: str) -> SGLangServer:
    k = v.get("k", k)  # a variant may speculate a different K; "auto": no flag, the plugin measures and picks
    extra = ["--dtype", v.get("target_dtype", "float32"), "--max-running-requests", "8"]
    env, name = {}, v["name"]
    endpoint, stats = f"ipc://{workdir}/{name}.sock", os.path.join(workdir, f"{name}.json")
    if os.path.exists(stats):  # --fresh-servers: the previous repeat's server's counters are not this one's
        os.remove(stats)
    if v["mode"] != "ar":
        extra += ["--speculative-algorithm", "saguaro", "--speculative-draft-model-path", v.get("draft", paths.draft_path())]
        extra += [] if k == "auto" else ["--speculative-num-steps", str(int(k))]
        cfg = {"mode": "sync" if v["mode"] == "sd" else "async", "fan_out": 4, "draft_endpoint": endpoint,
               "stats_file": stats, "stats_interval": 100000, **v.get("config", {})}
        env["SGLANG_SSD_CONFIG"] = json.dumps(cfg)
    env.update(v.get("env", {}))  # e.g. a draft knob such as SGLANG_SSD_BUILD_BUDGET (the draft inherits it)
    tree = str(Path(v["tree"]).resolve()) if v.get("tree") else None
    if tree:  # the server, and the draft it spawns, import sglang_ssd from that checkout: on PYTHONPATH and as
        # the working directory, since `python -m` puts the working directory first on sys.path (run from
        # this checkout, the servers would otherwise import ITS sglang_ssd whatever PYTHONPATH says)
        env["PYTHONPATH"] = os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")])
    srv = SGLangServer(paths.target_path(), extra, env=env, cpu_core=0, log_path=os.path.join(workdir, f"{name}.log"),
                       cwd=tree or str(HERE.parent))
    srv.endpoint, srv.stats_path = (endpoint if v["mode"] != "ar" else None), stats
    srv.tree = tree  # its draft speaks that checkout's protocol: bench_cpu reads its health through it
    return srv


def check_tree(v: dict, log_path: str) -> None:
    """A speculative variant's worker logs the checkout it imported sglang_ssd from: it must be the variant's."""
    if v["mode"] == "ar":
        return
    want = str(Path(v.get("tree") or HERE.parent).resolve())
    lines = [ln for ln in Path(log_path).read_text(errors="replace").splitlines() if "sglang_ssd from" in ln]
    got = lines[-1].rsplit("sglang_ssd from ", 1)[1].rstrip(")") if lines else None
    if got is not None and got != want:
        raise SystemExit(f"variant {v['name']} runs sglang_ssd from {got}, not {want}")
    log.info("variant %s: sglang_ssd from %s", v["name"], got or "(not logged: a tree older than this check)")


def _median(xs: list) -> float:
    xs = sorted(x for x in xs if isinstance(x, (int, float)))
    if not xs:
        return float("nan")
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def summary(state: dict) -> dict:
    """(variant, T, b) -> medians over repeats of each column (and the ratio of tok/s per repeat)."""
    out = {}
    for v in state["variants"]:
        for key in sorted({(c["temperature"], c["batch"]) for c in state["cells"].values()}):
            runs = [c for c in state["cells"].values()
                    if c["variant"] == v["name"] and (c["temperature"], c["batch"]) == key]
            if runs:
                out[(v["name"], *key)] = {col: _median([r.get(col) for r in runs]) for col in COLUMNS}
                out[(v["name"], *key)]["runs"] = runs
    return out


def report(state: dict) -> str:
    lines = [f"# Variants: {state['name']}", "",
             f"{state['machine']['cpu']}, {state['machine']['cores']} cores; torch {state['machine']['torch']}, "
             f"SGLang {state['machine']['sglang']}. Target on core 0, draft on core 1; K = {state['k']}, "
             f"{state['tokens']} tokens per request (EOS ignored). Every variant's server is up for the whole "
             + ("repeat (started anew each repeat) " if state.get("fresh_servers") else "run ")
             + f"and each cell runs on every variant in turn, repeat after repeat (the other servers frozen with "
             f"SIGSTOP meanwhile: an idle SGLang scheduler spins), "
             f"so drift of the machine hits all variants alike; medians over {state['repeats']} repeat(s) "
             f"(repeat r uses bench_cpu's prompts of repeat r) (scripts/bench_variants.py).", "",
             "| variant | mode | T | b | " + " | ".join(COLUMNS) + " | vs first of mode [min-max] | vs AR |",
             "|---|---|---|---|" + "---|" * (len(COLUMNS) + 2)]
    summ = summary(state)
    for key in sorted({(c["temperature"], c["batch"]) for c in state["cells"].values()}):
        firsts, ar = {}, None
        for v in state["variants"]:
            m = summ.get((v["name"], *key))
            if m is None:
                continue
            if v["mode"] == "ar" and ar is None:
                ar = v["name"]
            first = firsts.setdefault(v["mode"], v["name"])
            per_rep = {r["rep"]: r["tok_s"] for r in m["runs"]}
            base = {r["rep"]: r["tok_s"] for r in summ[(first, *key)]["runs"]}
            ratios = [per_rep[i] / base[i] for i in per_rep if i in base]
            vs_ar = ""
            if ar:
                ar_runs = {r["rep"]: r["tok_s"] for r in summ[(ar, *key)]["runs"]}
                vs_ar = f"{_median([per_rep[i] / ar_runs[i] for i in per_rep if i in ar_runs]):.3f}"
            vals = [f"{m[col]:.4g}" for col in COLUMNS]
            lines.append(f"| {v['name']} | {v['mode']} | {key[0]:g} | {key[1]} | " + " | ".join(vals)
                         + f" | {_median(ratios):.3f} [{min(ratios):.2f}-{max(ratios):.2f}] | {vs_ar or '-'} |")
    lines += ["", "Variants:", ""] + [f"- `{v['name']}`: `{json.dumps(v)}`" for v in state["variants"]]
    return "\n".join(lines) + "\n"


def start_all(stack: contextlib.ExitStack, args, tok, order, workdir: str, state: dict) -> dict:
    """Every variant's server, started one at a time, warmed, then frozen (an idle SGLang scheduler spins).
    Records each server's anonymous memory on huge pages (MB, all its processes) in state["huge_pages_mb"]."""
    servers = {}
    for v in args.variant:
        try:
            srv = stack.enter_context(server(v, args.k, workdir))
        except (RuntimeError, TimeoutError) as e:  # e.g. SGLang's own post-start request timing out (10 s)
            log.warning("%s: start failed (%s); starting it once more", v["name"], e)
            srv = stack.enter_context(server(v, args.k, workdir))
        servers[v["name"]] = srv
        srv.generate(input_ids=encode_prompt(tok, order[0]), sampling_params={"max_new_tokens": 8})
        hp = sum(p["anon_huge_kb"] for p in srv.huge_pages().values()) // 1024
        state.setdefault("huge_pages_mb", {}).setdefault(v["name"], []).append(hp)
        srv.pause()
        check_tree(v, os.path.join(workdir, f"{v['name']}.log"))
    return servers


def run_repeat(rep: int, args, servers: dict, tok, order, state: dict, out: Path) -> None:
    """One repeat: every (T, b) cell on every variant in turn, the others frozen; ABBA order over repeats."""
    for t in (float(x) for x in args.temps.split(",")):
        for b in (int(x) for x in args.batches.split(",")):
            c = {"tier": 1 if b == 1 else 2, "temperature": t, "batch": b, "rep": rep}
            items = cell_prompts(order, c)
            for v in (args.variant if rep % 2 == 0 else args.variant[::-1]):
                srv = servers[v["name"]]
                srv.resume()
                time.sleep(1.0)
                r = run_cell(srv, c, [encode_prompt(tok, p) for p in items], args.tokens)
                if os.path.exists(srv.stats_path):  # the K the server ran (auto: chosen)
                    r["k"] = json.load(open(srv.stats_path)).get("k")
                srv.pause()
                state["cells"][f"{v['name']}|{t}|{b}|{rep}"] = {**c, "variant": v["name"], **r}
                log.info("rep %d %s T=%g b=%d: %.2f tok/s", rep, v["name"], t, b, r["tok_s"])
                out.with_suffix(".json").write_text(json.dumps(state, indent=1) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--name", required=True)
    ap.add_argument("--variant", action="append", required=True, type=json.loads)
    ap.add_argument("--batches", default="1")
    ap.add_argument("--temps", default="0,1")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--fresh-servers", action="store_true",
                    help="start every server anew each repeat: identical SSD servers kept target verify times up "
                         "to 10-13%% apart for their whole life (results/variants_aa_spread.md), a factor that ABBA order "
                         "does not cancel; fresh processes turn it into repeat-to-repeat spread")
    ap.add_argument("--resume", action="store_true",
                    help="keep the complete repeats of results/variants_<name>.json (same variants) and run the rest")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(paths.target_path())
    order = ordered_prompts(json.loads(PROMPTS.read_text())["prompts"])
    out = RESULTS / f"variants_{args.name}"
    state = {"name": args.name, "machine": machine(), "k": args.k, "tokens": args.tokens,
             "repeats": args.repeats, "variants": args.variant, "fresh_servers": args.fresh_servers, "cells": {}}
    done = set()
    if args.resume and out.with_suffix(".json").exists():  # keep the finished repeats of an interrupted run
        old = json.loads(out.with_suffix(".json").read_text())
        if old["variants"] != args.variant or old["k"] != args.k or old["tokens"] != args.tokens:
            raise SystemExit(f"--resume: {out.with_suffix('.json')} was a run of other variants / K / tokens")
        n_cells = len(args.variant) * len(args.temps.split(",")) * len(args.batches.split(","))
        reps = [c["rep"] for c in old["cells"].values()]
        done = {r for r in set(reps) if reps.count(r) == n_cells}
        state["cells"] = {k: c for k, c in old["cells"].items() if c["rep"] in done}
        state["huge_pages_mb"] = old.get("huge_pages_mb", {})
        log.info("resuming %s: repeats %s done", out.name, sorted(done))
    workdir = tempfile.mkdtemp(prefix="bench-variants-")
    with contextlib.ExitStack() as stack:
        servers = {} if args.fresh_servers else start_all(stack, args, tok, order, workdir, state)
        for rep in range(args.repeats):
            if rep in done:
                continue
            with contextlib.ExitStack() as rep_stack:
                if args.fresh_servers:  # new processes each repeat: a per-process speed factor becomes repeat noise
                    servers = start_all(rep_stack, args, tok, order, workdir, state)
                run_repeat(rep, args, servers, tok, order, state, out)
            out.with_suffix(".md").write_text(report(state))
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
