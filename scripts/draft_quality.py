#!/usr/bin/env python
"""Rank draft candidates by PREDICTED SSD tokens/s (the paper's speedup formula with measured inputs).

Inputs, all measured here:
  - alpha greedy / T=1 per prompt kind, and the reduced head's coverage, on the held-out prompts
    (scripts/prompts_heldout.json; target greedy trajectories, 64 tokens each);
  - per round at T=0, simulated EXACTLY on those trajectories: accepted length k (draft argmax matches the
    target token, up to K) and whether the bonus token is among the cached top-F guesses at depth k (the
    drafted token excluded when k < K, as the draft engine does), so E (tokens/round) and p_hit;
    at T=1 the same by Monte Carlo with speculative sampling on the per-position p and q (contexts are the
    greedy trajectory's: an approximation);
  - costs with our draft runner (fp32, one thread, batch 1, ~128-token context): draft 1-token step T_d,
    glue forward of K+1 tokens, tree step of B = (K+1)F branches, target 1-token decode T_1 and (K+1)-token
    verify T_v (the target is a Llama, so the same runner times it).
Prediction (per round, seconds; RPC and scheduler overheads ignored):
  AR  1 token per T_1
  SD  E tokens per K*T_d + T_v                                       (K sequential draft steps, then verify)
  SSD E tokens per p_hit*max(T_v, T_build) + (1-p_hit)*(T_v + K*T_d)  (T_build = glue + K tree steps; a miss
      pays a just-in-time neural backup)                              -- Theorem 7 of the paper, in seconds
Writes results/draft_quality.json and results/draft_quality.md.

Usage:
    python scripts/draft_quality.py --run RUN_DIR [--run RUN_DIR ...] [--model PREPARED_DIR ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from sglang_ssd import paths  # noqa: E402
from sglang_ssd.draft.model import CausalLM, load_model  # noqa: E402
from sglang_ssd.draft.runner import DraftRunner, ForwardItem  # noqa: E402

log = logging.getLogger("draft_quality")
RESULTS = HERE.parent / "results"
KS, FS = (3, 4, 5), (1, 2, 3, 4)


# ----------------------------------------------------------------------------------------------- costs
def _median_ms(fn, reps: int = 12, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def costs(model: CausalLM, ctx: int = 128, ks=KS, fs=FS) -> dict:
    """ms for a 1-token step, (K+1)-token glue/verify, and tree steps of (K+1)F branches (one thread)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        r = DraftRunner(model)
        kv = r.new_kv(ctx + 64)
        r.forward([ForwardItem.extend(kv, list(range(100, 100 + ctx)), 0)])
        out = {"step_1": _median_ms(lambda: r.forward([ForwardItem.extend(kv, [7], ctx)]))}
        for k in ks:
            out[f"extend_{k + 1}"] = _median_ms(lambda: r.forward([ForwardItem.extend(kv, [7] * (k + 1), ctx, k + 1)]))
        for b in sorted({(k + 1) * f for k in ks for f in fs}):
            out[f"tree_{b}"] = _median_ms(lambda: r.forward([ForwardItem.extend(kv, [7] * b, ctx, b)]), reps=6)
        return {k: round(v, 2) for k, v in out.items()}
    finally:
        torch.set_num_threads(old)


# ----------------------------------------------------------------------------------------------- acceptance
@torch.no_grad()
def per_position(model: CausalLM, ref: dict) -> list[dict]:
    """Per held-out sequence: target probs p, draft probs q at every generated position, target tokens."""
    out = []
    for kind, (ids, plen), tlp in zip(ref["kinds"], ref["seqs"], ref["logp"]):
        h = model.forward_padded(ids[None])[0, plen - 1: len(ids) - 1]
        q = torch.softmax(model.logits(h), -1)
        out.append({"kind": kind, "p": tlp.float().exp(), "q": q, "tok": ids[plen:]})
    return out


def alpha_table(pp: list[dict], head_ids) -> dict:
    res = {}
    for kind in sorted({s["kind"] for s in pp}) + ["all"]:
        ss = [s for s in pp if kind == "all" or s["kind"] == kind]
        g = torch.cat([(s["p"].argmax(-1) == s["q"].argmax(-1)).float() for s in ss])
        o = torch.cat([torch.minimum(s["p"], s["q"]).sum(-1) for s in ss])
        row = {"alpha_greedy": round(g.mean().item(), 4), "alpha_t1": round(o.mean().item(), 4)}
        if head_ids is not None:
            inside = torch.zeros(ss[0]["p"].shape[-1], dtype=torch.bool)
            inside[head_ids] = True
            row["coverage_greedy"] = round(torch.cat([inside[s["tok"]].float() for s in ss]).mean().item(), 4)
            row["coverage_t1"] = round(torch.cat([s["p"][:, inside].sum(-1) for s in ss]).mean().item(), 4)
        res[kind] = row
    return res


def rounds_greedy(pp: list[dict], k: int, f: int) -> tuple[float, float]:
    """Exact T=0 rounds on the trajectories: E[k_acc + 1] and P(bonus in cached top-F at depth k_acc)."""
    tokens, hits, n = 0, 0, 0
    for s in pp:
        top = s["q"].topk(f + 1, -1).indices  # [N, F+1]
        match = (top[:, 0] == s["tok"])
        for t in range(len(s["tok"]) - k):
            acc = 0
            while acc < k and match[t + acc]:
                acc += 1
            cand = top[t + acc, 1:f + 1] if acc < k else top[t + acc, :f]  # drafted token excluded on reject
            hits += int((cand == s["tok"][t + acc]).any())
            tokens += acc + 1
            n += 1
    return tokens / n, hits / n


def rounds_sampled(pp: list[dict], k: int, f: int, draws: int = 2, seed: int = 0) -> tuple[float, float]:
    """Monte Carlo T=1 rounds: speculative sampling with q, bonus from the residual (or p after K accepts)."""
    g = torch.Generator().manual_seed(seed)
    tokens, hits, n = 0, 0, 0
    for s in pp:
        p, q = s["p"], s["q"]
        top = q.topk(f + 1, -1).indices
        for t in range(0, len(s["tok"]) - k):
            for _ in range(draws):
                acc = 0
                while acc < k:
                    x = torch.multinomial(q[t + acc], 1, generator=g).item()
                    if torch.rand(1, generator=g).item() < min(1.0, (p[t + acc, x] / q[t + acc, x]).item()):
                        acc += 1
                        continue
                    break
                if acc < k:
                    res = (p[t + acc] - q[t + acc]).clamp_min(0)
                    bonus = torch.multinomial(res / res.sum(), 1, generator=g).item()
                    cand = top[t + acc, :f + 1].tolist()
                    cand = [c for c in cand if c != x][:f]
                else:
                    bonus = torch.multinomial(p[t + acc], 1, generator=g).item()
                    cand = top[t + acc, :f].tolist()
                hits += int(bonus in cand)
                tokens += acc + 1
                n += 1
    return tokens / n, hits / n


def predict(c_d: dict, c_t: dict, e: float, p_hit: float, k: int, f: int) -> dict:
    t1, tv, td = c_t["step_1"], c_t[f"extend_{k + 1}"], c_d["step_1"]
    build = c_d[f"extend_{k + 1}"] + k * c_d[f"tree_{(k + 1) * f}"]
    ar = 1000 / t1
    sd = 1000 * e / (k * td + tv)
    ssd = 1000 * e / (p_hit * max(tv, build) + (1 - p_hit) * (tv + k * td))
    return {"K": k, "F": f, "E": round(e, 3), "p_hit": round(p_hit, 3), "T_p": round(build / tv, 3),
            "T_sd": round(k * td / tv, 3), "ar_tok_s": round(ar, 2), "sd_tok_s": round(sd, 2),
            "ssd_tok_s": round(ssd, 2), "sd_over_ar": round(sd / ar, 3), "ssd_over_ar": round(ssd / ar, 3),
            "ssd_over_sd": round(ssd / sd, 3)}


def evaluate(name: str, model: CausalLM, info: dict, ref: dict, c_t: dict) -> dict:
    pp = per_position(model, ref)
    head = model.head_ids
    row = {"name": name, **{k: v for k, v in info.items() if k != "curve"},
           "alpha": alpha_table(pp, head), "cost_ms": costs(model)}
    row["cost_ratio"] = round(row["cost_ms"]["step_1"] / c_t["step_1"], 3)
    preds = {"t0": [], "t1": []}
    for k in KS:
        for f in FS:
            preds["t0"].append(predict(row["cost_ms"], c_t, *rounds_greedy(pp, k, f), k, f))
    best0 = max(preds["t0"], key=lambda r: r["ssd_tok_s"])
    for k in sorted({best0["K"], 4}):  # T=1 Monte Carlo only where it matters (it is slow)
        for f in sorted({best0["F"], 3}):
            preds["t1"].append(predict(row["cost_ms"], c_t, *rounds_sampled(pp, k, f), k, f))
    row["predictions"] = preds
    row["best_t0"] = best0
    row["best_t1"] = max(preds["t1"], key=lambda r: r["ssd_tok_s"])
    if "curve" in info:
        row["curve"] = [{"positions": c["positions"], "minutes": c["minutes"],
                         "alpha_greedy": c["alpha"]["all"]["alpha_greedy"], "alpha_t1": c["alpha"]["all"]["alpha_t1"]}
                        for c in info["curve"]]
    log.info("%s: alpha %s, cost %.3f, best T=0 %s", name, row["alpha"]["all"], row["cost_ratio"], best0)
    return row


def write_md(res: dict, path: Path) -> None:
    L = ["# Draft candidates ranked by predicted SSD speed (issues 4 and 15)", "",
         f"Machine: {res['machine']}. Target costs (fp32, 1 thread): {res['target_cost_ms']}.",
         "Held-out: 20 prompts (5 chat, 5 code, 5 factual, 5 math) x 64 target-greedy tokens. Predictions use the",
         "paper's formula with these measured inputs (see scripts/draft_quality.py); RPC/scheduler overheads ignored.",
         "", "| draft | layers | head | train min | positions seen | alpha greedy | alpha T=1 | coverage greedy/T=1 |"
         " cost (1-token) | best K,F (T=0) | E | p_hit | T_p | SD/AR | SSD/AR | SSD/SD | SSD/AR T=1 | SSD/SD T=1 |",
         "|---" * 18 + "|"]
    for r in res["candidates"]:
        a, b, b1 = r["alpha"]["all"], r["best_t0"], r["best_t1"]
        cov = f"{a.get('coverage_greedy', 1.0):.3f} / {a.get('coverage_t1', 1.0):.3f}"
        L.append(f"| {r['name']} | {r.get('layers', '')} | {r.get('head_vocab') or 'full'} | {r.get('train_minutes', '-')} | "
                 f"{r.get('positions_seen', '-')} | {a['alpha_greedy']:.3f} | {a['alpha_t1']:.3f} | {cov} | "
                 f"{r['cost_ratio']:.3f} | {b['K']},{b['F']} | {b['E']:.2f} | {b['p_hit']:.2f} | {b['T_p']:.2f} | "
                 f"{b['sd_over_ar']:.2f} | {b['ssd_over_ar']:.2f} | {b['ssd_over_sd']:.2f} | "
                 f"{b1['ssd_over_ar']:.2f} | {b1['ssd_over_sd']:.2f} |")
    L += ["", "alpha by prompt kind (greedy / T=1):", ""]
    for r in res["candidates"]:
        L.append(f"- {r['name']}: " + ", ".join(f"{k} {v['alpha_greedy']:.3f}/{v['alpha_t1']:.3f}"
                                                 for k, v in r["alpha"].items() if k != "all"))
    L += ["", "Training curves (held-out alpha greedy / T=1 against positions seen):", ""]
    for r in res["candidates"]:
        if r.get("curve"):
            L.append(f"- {r['name']}: " + "; ".join(f"{c['positions']}: {c['alpha_greedy']:.3f}/{c['alpha_t1']:.3f}"
                                                     for c in r["curve"]))
    if res.get("data"):
        L += ["", f"Distillation data: {res['data']}"]
    path.write_text("\n".join(L) + "\n")


def training_record(model_dir: Path) -> dict:
    """A prepared draft's training minutes, positions seen and curve: from the draft.json (+ curve.json) its
    weights were assembled from (assets/draft when PREPARED.json's asset_sha256 is that file's; a draft.json in the dir
    itself otherwise); {} for a draft without one (the lens draft)."""
    rec = model_dir / "draft.json"
    try:
        marker = json.loads((model_dir / "PREPARED.json").read_text())
    except (OSError, ValueError):
        marker = {}
    asset = HERE.parent / "assets" / "draft"
    if marker.get("asset_sha256") and (asset / "draft.safetensors").exists():
        import hashlib
        if hashlib.sha256((asset / "draft.safetensors").read_bytes()).hexdigest() == marker["asset_sha256"]:
            rec = asset / "draft.json"
    if not rec.exists():
        return {}
    d = json.loads(rec.read_text())
    out = {k: d[k] for k in ("train_minutes", "positions_seen") if k in d}
    if rec.with_name("curve.json").exists():  # held-out alpha over the training run (train_draft.py)
        out["curve"] = json.loads(rec.with_name("curve.json").read_text())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", action="append", default=[], help="train_draft.py run dir (repeatable)")
    ap.add_argument("--model", action="append", default=[], help="prepared draft dir (repeatable)")
    ap.add_argument("--out", type=Path, default=RESULTS / "draft_quality")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from train_draft import heldout_reference, load_run
    from draft_data import data_dir
    torch.set_num_threads(1)
    ref = heldout_reference(data_dir() / "heldout_ref.pt")
    target = load_model(paths.target_path())
    c_t = costs(target)
    res = {"machine": f"{os.cpu_count()}-core CPU, torch {torch.__version__}, fp32", "target_cost_ms": c_t,
           "candidates": []}
    for rd in args.run:
        m, info = load_run(Path(rd))
        res["candidates"].append(evaluate(Path(rd).name, m, info, ref, c_t))
    for md in args.model:
        m = load_model(md)
        info = {"layers": m.cfg.num_layers, "head_vocab": m.cfg.head_vocab, **training_record(Path(md))}
        res["candidates"].append(evaluate(Path(md).name, m, info, ref, c_t))
    try:
        from draft_data import load_shards
        sh = load_shards()
        res["data"] = {"shards": len(sh), "positions": int(sum(s["label_pos"].numel() for s in sh)),
                       "tokens": int(sum(s["tokens"].numel() for s in sh))}
    except Exception as e:  # noqa: BLE001  (the data may live on another machine)
        log.warning("no data stats: %s", e)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    write_md(res, args.out.with_suffix(".md"))
    log.info("wrote %s.{json,md}", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
